"""Where offload's decode step goes on the host, with device gates (ft.engine.gates) and without
(FT_DECODE_GATES=0): per MoE layer, the microseconds the host spends in each phase of its loop
over the stops, and decode tok/s, from one engine per mode on the same model and GPU.

Phases: `wait` (gated: the poll for the stop rows; the GPU runs meanwhile), `prepare` (the
cache's bookkeeping and the misses' copies), `open` (gated), `prefetch` (the guesses' copies),
`launch` (graph replays: once a step gated, once a stretch without), `rest` (the step's other
host time: without gates, the ids' sync is in it).

    python scripts/bench_stop_phases.py --model DIR [--gates on,off] [--tokens 32] [--batch 1]
        [--cache-rate 0.15]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from ft.engine.config import EngineConfig
from ft.engine.runner import LLMEngine, SamplingParams


def timed(owner, name: str, phase: str, spent: dict) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def measure(model: str, gates: bool, tokens: int, batch: int, rate: float) -> dict:
    os.environ["FT_DECODE_GATES"] = "1" if gates else "0"
    config = EngineConfig(model=model, device="cuda", moe_strategy="offload", moe_cache_rate=rate,
                          max_model_len=128, max_num_seqs=batch)  # fmt: skip
    engine = LLMEngine(config)
    graphs, strategy = engine.graphs, engine.strategy
    assert (graphs.gates is not None) == gates
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens + 4, ignore_eos=True)
        engine.add_request([5 + i, 9, 13, 21, 40, 2, 77, 31], params)
    for _ in range(4):  # prefill, then the captures' steps
        engine.step()
    spent: dict[str, float] = defaultdict(float)
    if gates:
        timed(graphs.gates, "rows_of", "wait", spent)
        timed(graphs.gates, "open", "open", spent)
        timed(strategy, "prepare_gated", "prepare", spent)
    else:
        timed(strategy, "prepare", "prepare", spent)
    timed(strategy, "prefetch", "prefetch", spent)
    replay = torch.cuda.CUDAGraph.replay
    timed(torch.cuda.CUDAGraph, "replay", "launch", spent)
    torch.cuda.synchronize()
    fetched, start, steps = strategy.counters()["experts_fetched"], time.perf_counter(), 0
    while engine.has_unfinished() and steps < tokens:
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    torch.cuda.CUDAGraph.replay = replay
    per_layer = steps * len(graphs.cuts)
    phases = {k: round(v / per_layer * 1e6, 1) for k, v in spent.items()}
    phases["rest"] = round((elapsed - sum(spent.values())) / per_layer * 1e6, 1)
    fetched = strategy.counters()["experts_fetched"] - fetched
    engine.close()
    return {
        "gates": gates, "batch": batch, "tok_s": round(steps * batch / elapsed, 1),
        "step_ms": round(elapsed / steps * 1e3, 2), "us_per_layer": phases,
        "fetched_per_step": round(fetched / max(steps, 1), 2),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache-rate", type=float, default=0.15)
    p.add_argument("--gates", default="on,off", help="the modes to measure, in this order")
    a = p.parse_args()
    for mode in a.gates.split(","):
        gates = {"on": True, "off": False}[mode]
        print(json.dumps(measure(a.model, gates, a.tokens, a.batch, a.cache_rate)), flush=True)


if __name__ == "__main__":
    main()
