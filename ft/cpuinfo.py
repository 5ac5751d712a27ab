"""Facts about the host CPU that the engine, the bandwidth profile and the probes all report."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from functools import cache
from pathlib import Path

import psutil

# Widest first: the executor's log line and the profile name the best one present.
_ISA_ORDER = (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2"), ("asimd", "neon"))


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty off Linux)."""
    facts: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return facts
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        facts[key.strip()] = value.strip()
    return facts


def model_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model name") or platform.processor() or "unknown"


def isa_flags() -> set[str]:
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def best_isa() -> str:
    flags = isa_flags()
    return next((name for flag, name in _ISA_ORDER if flag in flags), platform.machine() or "?")


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def allowed_cores() -> list[int]:
    """Cores this process may run on (its affinity mask), ascending."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (None where there is none to load)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def current_cpu() -> int | None:
    """The core the calling thread runs on now (sched_getcpu), or None where libc lacks it."""
    getcpu = getattr(libc(), "sched_getcpu", None)
    if getcpu is None:
        return None
    cpu = getcpu()
    return cpu if cpu >= 0 else None
