"""Replay the expert cache's decisions on the CPU, without a model or a GPU: how many misses a
decode step takes under each way of following it, from a synthetic routing trace (skewed
popularity per layer, a share of each layer's experts reused from the previous token, guesses
of the next layers partly right). Copies complete at once, so only the cache's rules differ.

    python scripts/replay_cache.py [--layers 48] [--experts 128] [--top-k 8] [--slots 922]
        [--steps 60] [--reuse 0.6] [--guess 0.7] [--window 2]

One line per policy: host stops (offload's `ensure` then `prefetch`), zero-copy's `follow`
(slots taken from finished layers only; its misses are read in place, then copied for the next
token) and device gates (`follow` with gates: any layer but the open one; misses copied at
once); a step's misses (routed experts without a slot when their layer is routed), copies and
guessed copies, averaged over the steps after the first ten (round AM in docs/perf.md).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ft.engine.experts.cache import ExpertCache
from ft.engine.experts.store import HostExpertStore
from ft.engine.experts.zero_copy import ZeroCopyCache


def routing(rng, popularity, previous, top_k: int, reuse: float) -> list[list[int]]:
    """Each layer's experts for one token: some of the previous token's, the rest drawn by
    popularity."""
    token = []
    for layer, p in enumerate(popularity):
        kept = [e for e in (previous[layer] if previous else []) if rng.random() < reuse]
        drawn = [int(e) for e in rng.choice(len(p), size=3 * top_k, p=p)]
        token.append(list(dict.fromkeys(kept + drawn))[:top_k])
    return token


def replay(policy: str, args) -> tuple[float, float, float]:
    rng = np.random.default_rng(0)
    popularity = [rng.dirichlet(np.full(args.experts, 0.1)) for _ in range(args.layers)]
    layers = range(args.layers)
    store = HostExpertStore.allocate(args.layers, layers, args.experts, 4, 2, torch.float32)
    if policy == "stops":
        cache = ExpertCache(store, args.slots, "cpu", args.window)
    else:
        cache = ZeroCopyCache(store, args.slots, "cpu", args.window, gates=policy == "gates")
    previous, per_step = None, []
    for _ in range(args.steps):
        token = previous = routing(rng, popularity, previous, args.top_k, args.reuse)
        before, misses = (cache.loads, cache.prefetched), 0
        if policy != "stops":
            cache.begin_step()
        for layer in layers:
            experts = sorted(set(token[layer]))
            misses += sum(cache.slot_of(layer, e) is None for e in experts)  # when it is routed
            guesses = [
                (j, [e if rng.random() < args.guess else int(rng.integers(args.experts))
                     for e in token[j]])
                for j in range(layer + 1, min(layer + 3, args.layers))
            ]  # fmt: skip
            if policy == "stops":
                cache.ensure(layer, experts)
                for j, ids in guesses:
                    cache.prefetch(j, ids, layer)
            else:
                cache.follow(layer, experts, guesses)
        after = (cache.loads, cache.prefetched)
        per_step.append([misses] + [a - b for a, b in zip(after, before, strict=True)])
    return tuple(np.mean(per_step[10:], axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--slots", type=int, default=922)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reuse", type=float, default=0.6)
    parser.add_argument("--guess", type=float, default=0.7)
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    for policy in ("stops", "zero-copy", "gates"):
        misses, copies, prefetched = replay(policy, args)
        print(
            f"{policy}: {misses:.1f} misses, {copies:.1f} copies, {prefetched:.1f} guessed a step"
        )


if __name__ == "__main__":
    main()
