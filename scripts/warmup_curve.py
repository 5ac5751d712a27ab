"""Step times of `ft bench decode` runs from the first step of a process on, to tell whether a slow
run is slow for its process's age, its engine's age, or neither: rounds P to T saw a process's
first runs of offload at batch 1 ~25% slower than its later ones (docs/perf.md), a figure a user
running the bench once would take for the engine's speed.

    python scripts/warmup_curve.py --model DIR [--strategy offload] [--batch 1] [--engines 3]
        [--runs 4] [--tokens 48] [--cache-rate 0.15] [--profile FILE]

Loads the experts once; builds `--engines` engines one after another, each measuring `--runs`
runs with no warm-up. One JSON line per run: seconds since the process started, the engine and
run numbers, the median of each eighth of the run's steps, tok/s, and the host's state.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import psutil
import torch

from ft.bench import decode
from ft.bench.roofline import bandwidths
from ft.engine.config import EngineConfig

START = time.monotonic()


def host_mhz(cpu: int) -> float | None:
    """The current clock of one host CPU, where the box reports it."""
    freqs = psutil.cpu_freq(percpu=True) or []
    return round(freqs[cpu].current) if cpu < len(freqs) else None


def eighths(values: list[float]) -> list[float]:
    """Median of each eighth of `values`, in order: a run's curve in eight numbers."""
    size = max(1, len(values) // 8)
    return [round(statistics.median(values[i : i + size]), 2) for i in range(0, len(values), size)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--strategy", default="offload")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cache-rate", type=float, default=0.15)
    ap.add_argument("--profile")
    args = ap.parse_args()
    cfg = decode.DecodeBenchConfig(
        model=args.model, strategies=(args.strategy,), batches=(args.batch,),
        tokens=args.tokens, warmup=0, moe_cache_rate=args.cache_rate, profile=args.profile,
    )  # fmt: skip
    base = EngineConfig(model=cfg.model)
    store, shape = decode._load_store(base)
    bw = bandwidths(base.device, decode._profile_data(cfg.profile), quick=base.device == "cpu")
    process = psutil.Process()
    for e in range(args.engines):
        built = time.monotonic()
        engine = decode._engine(cfg, base, args.strategy, store)
        build_s = time.monotonic() - built
        for run in range(args.runs):
            switches = process.num_ctx_switches().involuntary
            row = decode._measure(engine, args.strategy, args.batch, cfg, shape, store, bw,
                                  lambda *_: None)  # fmt: skip
            cpu = process.cpu_num()
            print(json.dumps({
                "t": round(time.monotonic() - START, 1), "engine": e, "run": run,
                "build_s": round(build_s, 1) if run == 0 else None,
                "tok_s": round(row["tok_s"], 1), "step_ms_eighths": eighths(row["step_ms"]),
                "cache_misses": round(row["per_step"]["cache_misses"], 2),
                "experts_fetched": round(row["per_step"]["experts_fetched"], 2),
                "involuntary_switches": process.num_ctx_switches().involuntary - switches,
                "cpu": cpu, "cpu_mhz": host_mhz(cpu),
            }), flush=True)  # fmt: skip
        engine.close()
        del engine
        gc.collect()
        if base.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
