"""`python -m ft.bisect.workload_client URL OPTIONS_JSON`: one workload run through the API,
printed as `{"value": ..., ...}` on the last line (engine mode runs this in a child process)."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    base_url, opts = argv[0], json.loads(argv[1])
    try:
        from ft.bench.workload import run_workload
    except ImportError as exc:
        print(f"the workload client is missing: {exc}", file=sys.stderr)
        return 2
    res = run_workload(
        base_url,
        prompts=opts["prompts"],
        max_tokens=opts["max_tokens"],
        concurrency=opts["concurrency"],
        seed=0,
        model=None,
        timeout_s=opts["workload_timeout_s"],
    )
    if getattr(res, "errors", 0):
        print(f"{res.errors} of {opts['prompts']} requests failed", file=sys.stderr)
        return 3
    value = getattr(res, opts["figure"], None)
    if value is None:
        print(f"the workload result has no {opts['figure']!r}", file=sys.stderr)
        return 2
    print(json.dumps({"value": float(value), "ttft_s": getattr(res, "ttft_s", None)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
