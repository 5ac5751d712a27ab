"""Engine flags shared by `ft generate`, `ft serve`, `ft diagnose` and `ft bench`: one
Annotated type per flag and one function that turns them into an EngineConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", help="Model directory (HF layout). Default: the built-in tiny model."),
]
DeviceOpt = Annotated[
    str | None, typer.Option("--device", help="cpu | cuda (default: cuda when available).")
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype", help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)."
    ),
]
StrategyOpt = Annotated[
    str,
    typer.Option(
        "--moe-strategy",
        help="resident (all experts on the device) | offload (expert cache) | hybrid (offload, "
        "part of the misses on the CPU) | auto (resident if it fits, else the bandwidth profile).",
    ),
]
MaxFetchOpt = Annotated[
    str,
    typer.Option(
        "--moe-hybrid-max-fetch",
        help="hybrid: fraction F in [0, 1] of each step's misses fetched over PCIe (the rest on "
        "the CPU), or auto (from the bandwidth profile).",
    ),
]
CpuMoeThreadsOpt = Annotated[
    int | None,
    typer.Option("--cpu-moe-threads", help="CPU MoE pool threads (default: physical cores - 1)."),
]
CpuMoeInlineOpt = Annotated[
    bool,
    typer.Option(
        "--cpu-moe-inline",
        help="Fault injection: run the CPU expert work on the engine thread, not the pool "
        "(also FT_CPU_MOE_INLINE=1).",
    ),
]
BwProfileOpt = Annotated[
    Path | None,
    typer.Option("--bw-profile", help="Bandwidth profile (default: $FT_CACHE_DIR/benchbw.json)."),
]
CacheSizeOpt = Annotated[
    int | None, typer.Option("--moe-cache-size", help="Expert cache slots (all layers together).")
]
CacheRateOpt = Annotated[
    float | None,
    typer.Option("--moe-cache-rate", help="Expert cache as a fraction of all experts."),
]
CacheAutoOpt = Annotated[
    bool,
    typer.Option("--moe-cache-auto", help="Cache what fits after weights, KV cache and a margin."),
]
KvReserveOpt = Annotated[
    int | None,
    typer.Option("--kv-reserve-tokens", help="Tokens of KV cache to reserve (all sequences)."),
]
GpuMemoryOpt = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory-limit", help="GiB the engine may use on the device (emulate a small card)."
    ),
]
MaxNumSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Sequences decoded at once.")]
MaxModelLenOpt = Annotated[
    int | None, typer.Option("--max-model-len", help="Longest sequence (prompt + output).")
]


def engine_config_from_options(
    model: Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    moe_strategy: str = "resident",
    moe_cache_size: int | None = None,
    moe_cache_rate: float | None = None,
    moe_cache_auto: bool = False,
    kv_reserve_tokens: int | None = None,
    gpu_memory_limit: float | None = None,
    max_num_seqs: int = 8,
    max_model_len: int | None = None,
    moe_hybrid_max_fetch: str = "auto",
    cpu_moe_threads: int | None = None,
    cpu_moe_inline: bool = False,
    bw_profile: Path | None = None,
):
    """The EngineConfig for these flags; no --model means the built-in tiny model."""
    from ft.engine.config import EngineConfig
    from ft.engine.synth import builtin_tiny

    return EngineConfig(
        model=str(model) if model is not None else str(builtin_tiny()),
        device=device, dtype=dtype, moe_strategy=moe_strategy,
        moe_cache_size=moe_cache_size, moe_cache_rate=moe_cache_rate,
        moe_cache_auto=moe_cache_auto, kv_reserve_tokens=kv_reserve_tokens,
        gpu_memory_limit=gpu_memory_limit, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        moe_hybrid_max_fetch=moe_hybrid_max_fetch, cpu_moe_threads=cpu_moe_threads,
        cpu_moe_inline=cpu_moe_inline, bw_profile=str(bw_profile) if bw_profile else None,
    )  # fmt: skip
