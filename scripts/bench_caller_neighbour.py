"""The pool's call timed with another process busy on the caller's free cores.

On a GPU box the pool's caller shares the core its workers leave free with any other busy
thread, such as one in CUDA's default (spinning) wait: beside `ft bench bw`'s copier spinning
on its copies every call ended a scheduler tick late (4.0 ms; the copier now sleeps). This
times hybrid's call (one token, `--experts` experts, submit_routed) in rounds with no
neighbour, a neighbour that spins (`spin`: a busy loop, as CUDA's default wait) or one that
yields its core in a loop (`yield`), pinned to the cores no worker is pinned to:

    python scripts/bench_caller_neighbour.py --formats bf16 --calls 300 --rounds 2

One JSON line per round and neighbour: GB/s (median of the round's second half), p90 ms, the
caller's units, where the caller ran after each call (cpu -> calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from ft import cpuinfo
from ft.bench.bw_formats import FORMATS
from ft.engine.cpu.pool import CpuMoeExecutor

HIDDEN, INTER = 2048, 768  # qwen3-30b-a3b's expert
NEIGHBOURS = {"spin": "while True: pass", "yield": "import os\nwhile True: os.sched_yield()"}


def start_neighbour(kind: str, cores: list[int]) -> subprocess.Popen | None:
    if kind == "none":
        return None
    proc = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOURS[kind]],
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )  # fmt: skip
    time.sleep(0.3)  # running before the round starts
    return proc


def round_of_calls(pool, fmt, bank, x, count: int, experts: int, calls: int) -> dict:
    times, units, where, cursor = [], 0, {}, 0
    for _ in range(calls):
        chosen = [(cursor + j) % count for j in range(experts)]
        cursor = (cursor + experts) % count  # walk the store: no expert warm in cache
        ids = torch.tensor([chosen])
        start = time.perf_counter()
        handle = pool.submit_routed(x, bank, fmt.form.name, ids, torch.ones(ids.shape), chosen)
        handle.wait()
        times.append(time.perf_counter() - start)
        units += handle.caller_units
        cpu = str(cpuinfo.current_cpu())  # "None" where libc cannot say
        where[cpu] = where.get(cpu, 0) + 1
    steady = sorted(times[len(times) // 2 :])
    nbytes = experts * fmt.expert_bytes(HIDDEN, INTER)
    return {
        "gbs": round(nbytes / steady[len(steady) // 2] / 1e9, 2),
        "p90_ms": round(steady[int(0.9 * (len(steady) - 1))] * 1e3, 3),
        "caller_units": units,
        "caller_cpus": dict(sorted(where.items())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--neighbours", default="none,spin,yield")
    ap.add_argument("--store-experts", type=int, default=64)
    args = ap.parse_args()
    neighbours = args.neighbours.split(",")
    bad = [n for n in neighbours if n != "none" and n not in NEIGHBOURS]
    if bad:
        print(f"error: unknown neighbour {bad[0]!r} (none, spin, yield)", file=sys.stderr)
        return 1
    formats = args.formats.split(",")
    bad = [f for f in formats if f not in FORMATS or not FORMATS[f].cpu_path]
    if bad:
        print(f"error: no CPU pool path for format {bad[0]!r}", file=sys.stderr)
        return 1
    allowed = cpuinfo.allowed_cores()
    if len(allowed) < 2:
        print("error: one core: the pool leaves the caller no core of its own", file=sys.stderr)
        return 1
    for name in formats:
        fmt = FORMATS[name]
        count = max(args.store_experts, 2 * args.experts)
        _, bank = fmt.make_store(count, HIDDEN, INTER, pin=False)
        x = torch.randn(1, HIDDEN).to(fmt.dtype)
        with CpuMoeExecutor(threads=len(allowed) - 1) as pool:
            free = sorted(set(allowed) - set(pool.cores))
            for rnd in range(args.rounds):
                for kind in neighbours:
                    proc = start_neighbour(kind, free)
                    try:
                        row = round_of_calls(pool, fmt, bank, x, count, args.experts, args.calls)
                    finally:
                        if proc is not None:
                            proc.kill()
                            proc.wait()
                    row = {"fmt": name, "round": rnd, "neighbour": kind, **row}
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
