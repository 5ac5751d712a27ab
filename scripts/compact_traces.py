"""Chrome traces of `ft bench decode --trace` -> one gzip'd JSON of their timed events each, kept
to what decode_trace.device_timeline and a reader of the stops need (kernels, copies, CUDA runtime
calls, the step marks): a round's traces come back from the GPU machine within its file limits.

    python scripts/compact_traces.py OUT_DIR TRACE.json...
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "user_annotation")
ARGS = ("stream", "bytes", "correlation")


def compact(events: list[dict]) -> list[dict]:
    kept = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in CATS:
            continue
        args = {k: v for k, v in (e.get("args") or {}).items() if k in ARGS}
        kept.append({k: e[k] for k in ("cat", "name", "ts", "dur", "tid")} | {"args": args})
    return kept


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for path in map(Path, sys.argv[2:]):
        events = compact(json.loads(path.read_text())["traceEvents"])
        name = f"{path.parent.name}-{path.name.removesuffix('.trace.json')}.json.gz"
        with gzip.open(out / name, "wt") as f:
            json.dump({"traceEvents": events}, f)


if __name__ == "__main__":
    main()
