"""Every FT_* environment variable, read in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FT_CACHE_DIR: where profiles and built-in models live (default ~/.cache/freetoken)."""
    return Path(os.environ.get("FT_CACHE_DIR") or Path.home() / ".cache" / "freetoken")


def compile_cache_dir() -> Path:
    """Where the CPU pool's numba kernels are cached (ft.engine.cpu.jit): NUMBA_CACHE_DIR when
    set, else FT_CACHE_DIR/numba."""
    return Path(os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba")


def log_level() -> str:
    """FT_LOG_LEVEL: the engine's log level (default INFO)."""
    return os.environ.get("FT_LOG_LEVEL", "INFO").upper()


def cpu_moe_force_inline() -> bool:
    """FT_CPU_MOE_INLINE=1: fault injection; the CPU MoE executor computes on the calling thread
    instead of its pool (counted as experts_cpu_inline and warned once)."""
    return os.environ.get("FT_CPU_MOE_INLINE", "") not in ("", "0", "false", "no")


def cpu_moe_compute() -> str:
    """FT_CPU_MOE_COMPUTE: how the CPU MoE pool computes: auto (default) | compiled (the layer
    kernel, ft.engine.cpu.layer) | float32 | native (the row-block tasks, ft.engine.cpu.compute;
    quantised experts there by the compiled row kernels)."""
    value = os.environ.get("FT_CPU_MOE_COMPUTE", "auto").lower()
    return value if value in ("auto", "float32", "native", "compiled") else "auto"


def cpu_moe_spin_us() -> float:
    """FT_CPU_MOE_SPIN_US: how long the CPU MoE pool's threads spin for the next call before
    they sleep, in microseconds (default 5000: longer than a decode step's gaps between layer
    calls, so a call finds its workers awake; 0 sleeps at once, as llama.cpp's --poll 0)."""
    raw = os.environ.get("FT_CPU_MOE_SPIN_US", "5000")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        from ft.errors import FtError

        raise FtError(f"FT_CPU_MOE_SPIN_US must be microseconds >= 0, got {raw!r}")
    return value


def cuda_graphs() -> bool:
    """FT_CUDA_GRAPHS: replay decode as CUDA graphs (default on; 0 for eager, as vLLM's
    --enforce-eager): the whole step (resident), or each stretch between the per-layer host
    stops (offload, hybrid)."""
    return os.environ.get("FT_CUDA_GRAPHS", "1").lower() not in ("0", "false", "no")


def decode_attention() -> str:
    """FT_DECODE_ATTENTION: triton (default) | sdpa: decode attention as one Triton kernel that
    also writes the step's K/V, where the fused kernels are Triton (on the H200, 1.5x resident's
    decode over SDPA: docs/performance.md)."""
    value = os.environ.get("FT_DECODE_ATTENTION", "triton").lower()
    return value if value in ("sdpa", "triton") else "triton"


def api_key() -> str | None:
    """FT_API_KEY: the key `ft serve` requires and `ft bench serve` sends (default: none)."""
    return os.environ.get("FT_API_KEY") or None


# The stack agent runs inside the target, where `ft` may not be importable: it reads these by
# name (ft/probes/agent/sitecustomize.py); `ft diagnose` sets them through the functions below.
AGENT_OUT = "FT_AGENT_OUT"
AGENT_INTERVAL = "FT_AGENT_INTERVAL"
AGENT_ATTACH = "FT_AGENT_ATTACH"


def agent_out() -> str | None:
    """FT_AGENT_OUT: folder where the in-process stack agent writes stacks-PID.jsonl; unset: off."""
    return os.environ.get(AGENT_OUT) or None


def agent_interval() -> float:
    """FT_AGENT_INTERVAL: seconds between the agent's stack samples (default 0.1)."""
    return float(os.environ.get(AGENT_INTERVAL) or 0.1)


def agent_attach() -> str | None:
    """FT_AGENT_ATTACH: folder through which `ft diagnose --pid` asks a running process's stack
    agent for samples (a service's unit file sets it); the agent writes nothing until asked."""
    return os.environ.get(AGENT_ATTACH) or None
