"""Which kernels a graphed decode step spends its GPU time in: torch.profiler (CUPTI sees the
kernels inside CUDA graphs) over N decode steps, per strategy and batch size; one JSON line each
with the step's kernel time and, per kernel name, calls and microseconds a step.

    python scripts/profile_kernels.py --model DIR [--strategies resident,offload] [--batch 1,4]
        [--steps 8] [--cache-rate 0.15] [--top 16]

A kernel's time is its own span on the GPU; the gaps between kernels are not in it (see
scripts/bench_stop_phases.py's device_us for those).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ft.bench import decode
from ft.engine.config import EngineConfig
from ft.engine.runner import LLMEngine, SamplingParams


def measure(model: str, store, strategy: str, batch: int, steps: int, rate: float, top: int):
    extra = dict(moe_cache_rate=rate) if strategy != "resident" else {}
    config = EngineConfig(model=model, device="cuda", moe_strategy=strategy, max_model_len=256,
                          max_num_seqs=batch, **extra)  # fmt: skip
    engine = LLMEngine(config, expert_store=store if strategy != "resident" else None)
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 12, ignore_eos=True)
        engine.add_request([5 + i, 9, 13, 21, 40, 2, 77, 31], params)
    for _ in range(6):  # prefill, the captures, a few steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.close()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        row = kernels[event.name[:90]]
        row[0] += 1
        row[1] += event.time_range.elapsed_us()
    total = sum(us for _, us in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "strategy": strategy, "batch": batch, "steps": steps,
        "kernel_us_per_step": round(total / steps, 1),
        "kernels": [
            {"name": name, "calls_per_step": round(calls / steps, 2),
             "us_per_step": round(us / steps, 1), "us_per_call": round(us / max(calls, 1), 2)}
            for name, (calls, us) in ranked
        ],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--strategies", default="resident,offload")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cache-rate", type=float, default=0.15)
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args()
    store = None
    for strategy in a.strategies.split(","):
        if strategy != "resident" and store is None:
            store, _ = decode._load_store(EngineConfig(model=a.model))
        for batch in map(int, a.batch.split(",")):
            row = measure(a.model, store, strategy, batch, a.steps, a.cache_rate, a.top)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
