"""Repeated, interleaved `ft bench decode` runs of one strategy over settings, on ONE load of the
experts: runs of the same setting in separate processes differed by up to 25% at batch 1 on the
H200 box, so settings are compared within one process, each run several times.

    python scripts/bench_sweep.py --model DIR [--strategy offload,hybrid] [--depths auto,2,3]
        [--batch 1,4] [--variants "NAME:VAR=VALUE,...;..."] [--repeats 3] [--tokens 32] [--warmup 4]
        [--cache-rate 0.15] [--profile FILE] [--trace DIR]

--variants: environments to compare (each engine is built under its variables), e.g.
"sdpa:FT_DECODE_ATTENTION=sdpa;triton:FT_DECODE_ATTENTION=triton"; default one, unchanged.
Pseudo-variables set the engine instead: STRATEGY=NAME (another strategy than --strategy's),
WINDOW=N (--moe-prefetch-window), GATES=0|1 (--no-moe-gates, host stops | --moe-gates, offload's
default), DEPTH=N (--moe-prefetch-depth, instead of --depths), RATE=R (--moe-cache-rate, instead
of --cache-rate), FETCH=F (hybrid's --moe-hybrid-max-fetch). A comparison of code paths that
have no switch patches the code in a variant of this script.
One JSON line per (repeat, depth, variant, batch): tok/s, ratio to the roofline, median step ms,
the per-step counters, and the host's state over the run (`host`: the process's involuntary
context switches, the CPU its main thread ended on, the GPU's SM clock after it), to tell what
differs in a run that comes out slow. --trace DIR: each run also profiles a few steps (`ft bench
decode --trace`) into DIR/rREPEAT-dDEPTH-VARIANT, and its line gets the device `timeline`.
--by-layer: each line also gets `by_layer`, the experts copied and the misses per MoE layer, per
decode step (warm-ups included): where in the step the copies fall.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from contextlib import contextmanager

import psutil

from ft.bench import decode
from ft.bench.roofline import bandwidths
from ft.engine.config import EngineConfig
from ft.engine.strategies.hybrid import ROUND_TRIP

KEYS = (
    "cache_misses",
    "experts_fetched",
    "experts_prefetched",
    "prefetch_hits",
    "experts_in_place",
    "experts_cpu",
    "cpu_layers",  # hybrid: its decode layers with CPU experts, and their round trip's parts
    *(f"cpu_{part}_us" for part in ROUND_TRIP),
)


def variant(text: str) -> tuple[str, dict[str, str]]:
    """ "NAME:VAR=VALUE,VAR=VALUE" -> (NAME, {VAR: VALUE})."""
    name, _, assignments = text.partition(":")
    pairs = [a.split("=", 1) for a in assignments.split(",") if a.strip()]
    return name.strip(), {k.strip(): v.strip() for k, v in pairs}


@contextmanager
def environment(env: dict[str, str]):
    """These variables set, then the caller's environment back."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def engine_vars(env: dict[str, str]) -> tuple[dict[str, str], dict]:
    """A variant's pseudo-variables -> (the real environment, the engine settings they give):
    STRATEGY=NAME, WINDOW=N (--moe-prefetch-window), GATES=0|1 (--no-moe-gates | --moe-gates),
    DEPTH=N (--moe-prefetch-depth), RATE=R (--moe-cache-rate), FETCH=F
    (--moe-hybrid-max-fetch)."""
    env, settings = dict(env), {}
    if "STRATEGY" in env:
        settings["strategy"] = env.pop("STRATEGY")
    if "WINDOW" in env:
        settings["moe_prefetch_window"] = int(env.pop("WINDOW"))
    if "GATES" in env:
        settings["moe_gates"] = env.pop("GATES") == "1"
    if "DEPTH" in env:
        settings["moe_prefetch_depth"] = env.pop("DEPTH")  # a number or auto
    if "RATE" in env:
        settings["moe_cache_rate"] = float(env.pop("RATE"))
    if "FETCH" in env:
        settings["moe_hybrid_max_fetch"] = env.pop("FETCH")  # a fraction or auto
    return env, settings


def counted_by_layer(measure):
    """decode._measure, also counting the cache's copies and misses per layer over the decode
    steps -> its row with `by_layer` (per step)."""

    def wrapped(engine, *args):
        cache = getattr(engine.strategy, "cache", None)
        if cache is None:
            return measure(engine, *args)
        layers = len(cache.loads_by_layer)
        sums, steps, step = {"copied": [0] * layers, "misses": [0] * layers}, [0], engine.step

        def counted():
            before = list(cache.loads_by_layer), list(cache.misses_by_layer)
            step()
            if engine.last_step.get("phase") == "decode":
                steps[0] += 1
                for name, now, then in zip(sums, (cache.loads_by_layer, cache.misses_by_layer),
                                           before, strict=True):  # fmt: skip
                    sums[name] = [s + a - b for s, a, b in zip(sums[name], now, then, strict=True)]

        engine.step = counted
        try:
            row = measure(engine, *args)
        finally:
            del engine.step
        n = max(steps[0], 1)
        row["by_layer"] = {name: [round(v / n, 2) for v in values] for name, values in sums.items()}
        return row

    return wrapped


def host_state() -> dict:
    """What may differ between runs of one process on the host: counters to diff, and state."""
    process = psutil.Process()
    state = {"involuntary_switches": process.num_ctx_switches().involuntary,
             "cpu": process.cpu_num()}  # fmt: skip
    try:
        import pynvml

        pynvml.nvmlInit()
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        state["sm_mhz"] = pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM)
    except Exception:  # no NVML: the host's part still tells
        pass
    return state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--strategy", default="offload", help="one or several, comma-separated")
    ap.add_argument("--depths", default="auto", help="numbers or auto, comma-separated")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--variants", default="default:")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--cache-rate", type=float, default=0.15)
    ap.add_argument("--profile")
    ap.add_argument("--trace")
    ap.add_argument("--by-layer", action="store_true")
    args = ap.parse_args()
    if args.by_layer:
        decode._measure = counted_by_layer(decode._measure)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    shared = EngineConfig(
        model=args.model, device=args.device, moe_strategy="offload",
        moe_cache_rate=args.cache_rate, bw_profile=args.profile,
    )  # fmt: skip
    cfg = decode.DecodeBenchConfig(
        engine=shared, strategies=tuple(args.strategy.split(",")),
        batches=tuple(ints(args.batch)), tokens=args.tokens, warmup=args.warmup,
        profile=args.profile,
    )  # fmt: skip
    base = cfg.engine
    store, shape = decode._load_store(base)
    bw = bandwidths(base.device, decode._profile_data(cfg.profile), quick=base.device == "cpu")
    variants = [variant(text) for text in args.variants.split(";") if text.strip()]
    for repeat, strategy, depth, (name, env) in itertools.product(
        range(args.repeats), cfg.strategies, args.depths.split(","), variants
    ):
        env, settings = engine_vars(env)
        strategy = settings.pop("strategy", strategy)
        depth = settings.pop("moe_prefetch_depth", depth)
        trace = args.trace and os.path.join(args.trace, f"r{repeat}-{strategy}-d{depth}-{name}")
        engine = dataclasses.replace(cfg.engine, moe_prefetch_depth=depth, **settings)
        run = dataclasses.replace(cfg, engine=engine, strategies=(strategy,), trace=trace)
        before = host_state()
        with environment(env):
            rows = decode._run_strategy(run, base, strategy, store, shape, bw, lambda *_: None)
        after = host_state()
        after["involuntary_switches"] -= before["involuntary_switches"]
        for r in rows:
            step = r.get("per_step") or {}
            print(json.dumps({
                "repeat": repeat, "strategy": strategy, "depth": depth, "variant": name,
                "batch": r["batch"],
                "tok_s": r["tok_s"] and round(r["tok_s"], 1),
                "ratio": r.get("ratio") and round(r["ratio"], 4),
                "step_ms_median": r.get("step_ms_median"), "error": r.get("error"),
                **{k: round(step[k], 2) for k in KEYS if k in step},
                "host": after, "timeline": (r.get("trace") or {}).get("timeline"),
                **({"by_layer": r["by_layer"]} if "by_layer" in r else {}),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
