"""Fixture: stands in for `ft serve` (startup lines, ready line, /metrics) with the seed's fault.

Under --moe-strategy hybrid the main thread computes "experts" inline in a named function while
the ft-cpu-moe pool idles; under any other strategy it sleeps like a healthy engine thread.
"""

import http.server
import sys
import threading
import time


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ft_decode_tokens_per_second 0.5\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def inline_expert_ffn() -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        pass


if __name__ == "__main__":
    strategy = sys.argv[sys.argv.index("--moe-strategy") + 1]
    print(f"Resolved config: moe_strategy='{strategy}', expert_format='bf16', device='cpu'")
    stop = threading.Event()
    for k in range(2):
        threading.Thread(target=stop.wait, name=f"ft-cpu-moe-{k}", daemon=True).start()
    print("CPU MoE executor ready: threads=2 (pinned to cores 0..1) isa=avx2 fmt=bf16")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, name="uvicorn", daemon=True).start()
    print(f"API server is ready to serve on 127.0.0.1:{server.server_address[1]}", flush=True)
    inline_expert_ffn() if strategy == "hybrid" else time.sleep(60)
