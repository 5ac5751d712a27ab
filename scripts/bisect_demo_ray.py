"""Time `ft bisect` in engine mode over `ft demo`'s scratch history: `--jobs 1` without Ray
beside `--ray local`, each naming (or not) the planted commit. One JSON line per run.

    python scripts/bisect_demo_ray.py --out /tmp/bdr [--device cuda] [--runs local,ray]

The history, the model, the bandwidth profile and the engine flags are the demo's own
(ft/demo); the samples and reports of each run go to OUT/demo/RUN.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from ft.bisect.driver import bisect
from ft.demo.config import DemoConfig
from ft.demo.history import build_history
from ft.demo.prepare import demo_model, isolated_env, measure_profile
from ft.demo.stages import bisect_options

RAY = {"local": None, "ray": "local"}  # run name -> --ray


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a new folder")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--runs", default="local,ray", help="local, ray, or both")
    args = ap.parse_args()
    config = DemoConfig(out=args.out / "demo", device=args.device, prompts=1, max_tokens=16,
                        repeats=2)  # fmt: skip
    config.out.mkdir(parents=True)
    model = demo_model(print)
    profile = measure_profile(config, print)
    with isolated_env(config.out, profile.path):  # a Ray started below inherits it
        history = build_history(config.out / "scratch")
        base = bisect_options(config, history, model)
        for name in args.runs.split(","):
            opts = dataclasses.replace(base, out=str(config.out / name), ray=RAY[name])
            start = time.monotonic()
            rep = bisect(opts, lambda msg, name=name: print(f"{name}: {msg}", flush=True))
            found = (rep["culprit"] or {}).get("sha")
            print(json.dumps({"run": name, "device": args.device, "outcome": rep["outcome"],
                              "planted": found == history.planted_sha,
                              "seconds": round(time.monotonic() - start, 1),
                              "samples": rep["samples_taken"]}))  # fmt: skip


if __name__ == "__main__":
    main()
