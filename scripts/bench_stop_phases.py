"""Where offload's graphed decode step goes on the host: per MoE layer, the microseconds the host
spends in each phase of its loop over the stops, and decode tok/s.

Phases: `rows` (waiting for the stretch, then reading its stop rows: the ids' one sync),
`prepare` (the cache's bookkeeping and the misses' copies; of it, `ensure`), `launch` (a graph
replay per stretch), `prefetch` (the guesses' copies, while the next stretch runs), `rest` (the
step's other host time).

And the device's side of the same steps (`device_us`, from CUDA events recorded on the compute
stream just before and after each replay): `stretch`, a stretch's time on the GPU from reaching
its launch to its last kernel's end (its kernels and the gaps between them), and `gap`, the GPU
idle between one stretch's end and the next one's launch (the host's stop); medians per stretch.
`gaps_by_stop` splits the gaps by what the stop before them did: a demand miss (its copy, which
the next stretch waits for), a wait for a prefetch copy still running, or neither (the host's
own time): how many stops a step, and their mean gap.

    python scripts/bench_stop_phases.py --model DIR [--tokens 32] [--batch 1,4] [--cache-rate 0.15]
        [--variants "NAME:VAR=VALUE,...;..."]   (as scripts/bench_sweep.py's, one load of the
                                                 experts for all of them; WINDOW=N and
                                                 PIN=1 set the engine's flags)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections import defaultdict

import torch
from bench_sweep import engine_vars, environment, variant

from ft.bench import decode
from ft.engine import graphs as graphs_module
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


def measure(model: str, store, tokens: int, batch: int, rate: float, **settings) -> dict:
    config = EngineConfig(model=model, device="cuda", moe_strategy="offload", moe_cache_rate=rate,
                          max_model_len=128, max_num_seqs=batch, **settings)  # fmt: skip
    engine = LLMEngine(config, expert_store=store)
    graphs, strategy = engine.graphs, engine.strategy
    assert graphs is not None, "needs CUDA graphs (FT_CUDA_GRAPHS=1)"
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens + 4, ignore_eos=True)
        engine.add_request([5 + i, 9, 13, 21, 40, 2, 77, 31], params)
    for _ in range(4):  # prefill, then the captures' steps
        engine.step()
    spent: dict[str, float] = defaultdict(float)
    inside: dict[str, float] = defaultdict(float)  # within other phases
    timed(strategy, "prepare", "prepare", spent)
    cache, kinds = strategy.cache, []  # per stop: "demand" | "prefetch" | "none"
    inner_prepare, inner_wait = strategy.prepare, cache._wait_for_prefetch
    waited = [False]

    def wait_for_prefetch(key, stream, compute=False):
        n = cache._in_flight.get(key, 0)
        if compute and n > cache._waited and not cache._prefetch_events[n].query():
            waited[0] = True
        return inner_wait(key, stream, compute)

    def prepare(*args, **kwargs):
        misses, waited[0] = cache.misses, False
        inner_prepare(*args, **kwargs)
        kinds.append("demand" if cache.misses > misses else "prefetch" if waited[0] else "none")

    cache._wait_for_prefetch, strategy.prepare = wait_for_prefetch, prepare
    timed(strategy.cache, "ensure", "ensure", inside)
    timed(strategy, "prefetch", "prefetch", spent)
    replay, stop = torch.cuda.CUDAGraph.replay, graphs_module.stop
    marks: list[torch.cuda.Event] = []  # before and after each replay, in order
    timed(torch.cuda.CUDAGraph, "replay", "launch", spent)
    timed_replay = torch.cuda.CUDAGraph.replay

    def marked_replay(graph):
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        timed_replay(graph)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()

    torch.cuda.CUDAGraph.replay = marked_replay
    timed(graphs_module, "stop", "stop", inside)  # rows + prepare + the guesses' list
    torch.cuda.synchronize()
    fetched, start, steps = strategy.counters()["experts_fetched"], time.perf_counter(), 0
    while engine.has_unfinished() and steps < tokens:
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    torch.cuda.CUDAGraph.replay, graphs_module.stop = replay, stop
    torch.cuda.synchronize()
    spans = [a.elapsed_time(b) * 1e3 for a, b in itertools.pairwise(marks)]  # us
    per_step = 2 * (len(graphs.cuts) + 1)  # marks a step; the first step's first gap is its own
    gaps = [us for i, us in enumerate(spans) if i % 2 == 1 and (i + 1) % per_step != 0]
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, us in zip(kinds, gaps, strict=True):  # a stop, and the gap after it
        by_kind[kind].append(us)
    device_us = {
        "gaps_by_stop": {
            kind: {"per_step": round(len(v) / steps, 1), "mean_us": round(statistics.mean(v), 1)}
            for kind, v in sorted(by_kind.items())
        },
        "stretch": round(statistics.median(spans[0::2]), 1),
        "gap": round(statistics.median(gaps), 1),
        "step_stretches_ms": round(sum(spans[0::2]) / steps / 1e3, 2),
        "step_gaps_ms": round(sum(gaps) / steps / 1e3, 2),
    }
    spent["rows"] = inside.pop("stop") - spent["prepare"]
    per_layer = steps * len(graphs.cuts)
    phases = {k: round(v / per_layer * 1e6, 1) for k, v in (spent | inside).items()}
    phases["rest"] = round((elapsed - sum(spent.values())) / per_layer * 1e6, 1)
    fetched = strategy.counters()["experts_fetched"] - fetched
    engine.close()
    return {
        "batch": batch, "tok_s": round(steps * batch / elapsed, 1),
        "step_ms": round(elapsed / steps * 1e3, 2), "us_per_layer": phases,
        "fetched_per_step": round(fetched / max(steps, 1), 2), "device_us": device_us,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--cache-rate", type=float, default=0.15)
    p.add_argument("--variants", default="default:")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    store, _ = decode._load_store(EngineConfig(model=a.model))
    variants = [variant(text) for text in a.variants.split(";") if text.strip()]
    batches = [int(b) for b in a.batch.split(",")]
    for repeat, (name, env), batch in itertools.product(range(a.repeats), variants, batches):
        env, settings = engine_vars(env)
        with environment(env):
            result = measure(a.model, store, a.tokens, batch, a.cache_rate, **settings)
        print(json.dumps({"variant": name, "repeat": repeat, **result}), flush=True)


if __name__ == "__main__":
    main()
