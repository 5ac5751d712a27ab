"""Host time of offload's per-layer stop, without a GPU: `prepare` (the cache's bookkeeping for
the routed experts, their misses' loads) and `prefetch` (the next layers' guesses), on the CPU
device with tiny experts, so what is timed is the Python and torch overhead a stop adds on the
host. The GPU idles for that time at every MoE layer (docs/perf.md, round K's trace).

    python scripts/bench_stop_host.py [--layers 48] [--experts 128] [--top-k 8] [--slots 922]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from ft.engine.experts.store import HostExpertStore
from ft.engine.strategies.offload import OffloadStrategy


def routing(layers: int, experts: int, top_k: int, steps: int, reuse: float, seed: int = 0):
    """Per step and layer, top_k distinct experts; each kept from the last step with p=reuse,
    drawn from a skewed popularity otherwise (as the synthetic models route)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(experts)]
    last = [rng.sample(range(experts), top_k) for _ in range(layers)]
    out = []
    for _ in range(steps):
        step = []
        for layer in range(layers):
            keep = [e for e in last[layer] if rng.random() < reuse]
            while len(keep) < top_k:
                e = rng.choices(range(experts), weights)[0]
                if e not in keep:
                    keep.append(e)
            step.append(keep)
            last[layer] = keep
        out.append(step)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--slots", type=int, default=922)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--depth", type=int, default=2)
    a = p.parse_args()
    layers = range(a.layers)
    store = HostExpertStore.allocate(a.layers, layers, a.experts, 16, 16, torch.float32)
    strategy = OffloadStrategy(store, "cpu", a.slots, prefetch_depth=a.depth)
    plan = routing(a.layers, a.experts, a.top_k, a.steps, reuse=0.64)
    start = time.perf_counter()
    for step in plan:
        for layer in layers:
            strategy.prepare(layer, [step[layer]])
            for ahead in range(layer + 1, min(layer + 1 + a.depth, a.layers)):
                strategy.prefetch(ahead, [step[ahead]], keep_layer=layer)  # a perfect guess
    stops = a.steps * a.layers
    per_stop = (time.perf_counter() - start) / stops * 1e6
    c = strategy.counters()
    print(json.dumps({
        "us_per_stop": round(per_stop, 2), "stops": stops, "depth": a.depth,
        "loads_per_stop": round(c["experts_fetched"] / stops, 3),
        "torch": torch.__version__,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
