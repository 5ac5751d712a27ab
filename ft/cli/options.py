"""Engine flags, declared once: `@engine_options` gives a command every flag of the engine and
hands them to it as one `EngineFlags`, so `ft generate`, `ft serve` and the benchmarks never
repeat the list (a flag added here reaches every command); and the parsers of option values that
commands share."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from ft.errors import FtError


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags as given on the command line; `config()` makes the EngineConfig."""

    model: Annotated[
        Path | None,
        typer.Option(
            "--model", help="Model directory (HF layout). Default: the built-in tiny model."
        ),
    ] = None
    device: Annotated[
        str | None, typer.Option("--device", help="cpu | cuda (default: cuda when available).")
    ] = None
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)."
        ),
    ] = None
    expert_format: Annotated[
        str | None,
        typer.Option(
            "--expert-format",
            help="bf16 | int8 | fp8_block | nvfp4: the routed experts' format. Default: the "
            "checkpoint's (config.json quantization_config); another is an error.",
        ),
    ] = None
    moe_strategy: Annotated[
        str,
        typer.Option(
            "--moe-strategy",
            help="resident (all experts on the device) | offload (expert cache) | hybrid (offload, "
            "part of the misses on the CPU) | auto (resident if it fits, else the bandwidth "
            "profile).",
        ),
    ] = "resident"
    moe_hybrid_max_fetch: Annotated[
        str,
        typer.Option(
            "--moe-hybrid-max-fetch",
            help="hybrid: fraction F in [0, 1] of each step's misses fetched over PCIe (the rest "
            "on the CPU), or auto (from the bandwidth profile).",
        ),
    ] = "auto"
    cpu_moe_threads: Annotated[
        int | None,
        typer.Option(
            "--cpu-moe-threads", help="CPU MoE pool threads (default: physical cores - 1)."
        ),
    ] = None
    cpu_moe_inline: Annotated[
        bool,
        typer.Option(
            "--cpu-moe-inline",
            help="Fault injection: run the CPU expert work on the engine thread, not the pool "
            "(also FT_CPU_MOE_INLINE=1).",
        ),
    ] = False
    moe_prefetch: Annotated[
        bool,
        typer.Option(
            "--moe-prefetch/--no-moe-prefetch",
            help="offload, hybrid, CUDA graphs: at each MoE layer, also fetch the misses "
            "the next layers' routers pick from this layer's input, overlapped with compute.",
        ),
    ] = True
    moe_prefetch_depth: Annotated[
        str,
        typer.Option(
            "--moe-prefetch-depth",
            help="How many MoE layers ahead --moe-prefetch guesses and fetches (1-4), or auto: "
            "3 at batch 1 and 2 above with device gates (offload's default), 2 otherwise.",
        ),
    ] = "auto"
    moe_prefetch_window: Annotated[
        int | None,
        typer.Option(
            "--moe-prefetch-window",
            help="Prefetched experts queued for copy at once, the rest held on the host, so a "
            "miss waits behind at most that many (0: no bound). Default: 2, but 0 for hybrid's "
            "host stops.",
        ),
    ] = None
    moe_gates: Annotated[
        bool | None,
        typer.Option(
            "--moe-gates/--no-moe-gates",
            help="offload and hybrid: decode as one graph per step whose MoE layers each wait "
            "on the device (a gate in pinned memory) until the host has fetched their misses "
            "(hybrid: and computed its CPU's share), the host feeding the copy engine "
            "meanwhile; --no-moe-gates: a host sync and launch per layer (host stops). Default: "
            "on (hybrid: on CUDA only). On the H200: offload 3-6% ahead of host stops at batch "
            "1, ~7% at batch 4; hybrid 74-76% of its roofline against 57-63% "
            "(docs/performance.md).",
        ),
    ] = None
    bw_profile: Annotated[
        Path | None,
        typer.Option(
            "--bw-profile", help="Bandwidth profile (default: $FT_CACHE_DIR/benchbw.json)."
        ),
    ] = None
    moe_cache_size: Annotated[
        int | None,
        typer.Option("--moe-cache-size", help="Expert cache slots (all layers together)."),
    ] = None
    moe_cache_rate: Annotated[
        float | None,
        typer.Option("--moe-cache-rate", help="Expert cache as a fraction of all experts."),
    ] = None
    moe_cache_auto: Annotated[
        bool,
        typer.Option(
            "--moe-cache-auto", help="Cache what fits after weights, KV cache and a margin."
        ),
    ] = False
    kv_reserve_tokens: Annotated[
        int | None,
        typer.Option("--kv-reserve-tokens", help="Tokens of KV cache to reserve (all sequences)."),
    ] = None
    gpu_memory_limit: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-limit",
            help="GiB the engine may use on the device (emulate a small card).",
        ),
    ] = None
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", help="Sequences decoded at once.")
    ] = 8
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", help="Longest sequence (prompt + output).")
    ] = None

    def config(self, **overrides: Any):
        """The EngineConfig for these flags; no --model means the built-in tiny model."""
        from ft.engine.config import EngineConfig
        from ft.engine.synth.checkpoint import builtin_tiny

        flags = replace(self, **overrides)
        values = {f.name: getattr(flags, f.name) for f in fields(flags)}
        model = values.pop("model")
        return EngineConfig(
            model=str(model) if model is not None else str(builtin_tiny()), **values
        )


def _flag_parameters(exclude: frozenset[str]) -> list[inspect.Parameter]:
    hints = inspect.get_annotations(EngineFlags, eval_str=True)
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                          annotation=hints[f.name])
        for f in fields(EngineFlags) if f.name not in exclude
    ]  # fmt: skip


def engine_options(command=None, *, exclude: tuple[str, ...] = ()):
    """Decorator: add every engine flag (less `exclude`) to a typer command, which receives them
    as its `engine: EngineFlags` parameter."""

    def decorate(func):
        flag_params = _flag_parameters(frozenset(exclude))
        own = inspect.signature(func, eval_str=True)
        kept = [p for p in own.parameters.values() if p.name != "engine"]

        @functools.wraps(func)
        def wrapper(**kwargs):
            flags = EngineFlags(**{p.name: kwargs.pop(p.name) for p in flag_params})
            return func(engine=flags, **kwargs)

        params = kept + flag_params
        wrapper.__signature__ = own.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # typer must read the new signature, not the wrapped one
        return wrapper

    return decorate(command) if command is not None else decorate


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,8' -> (1, 2, 8); a one-line error naming `flag` for anything else."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise FtError(f"{flag} takes comma-separated integers, got {text!r}") from None
