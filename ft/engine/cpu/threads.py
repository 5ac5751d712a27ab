"""Thread plumbing for the CPU MoE pool: which cores, OS thread names, pinning, torch threads."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from ft import cpuinfo
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.engine.cpu.pool")
_PR_SET_NAME = 15


def pick_cores(threads: int | None, cores: list[int] | None) -> list[int]:
    allowed = cpuinfo.allowed_cores()
    if cores:
        bad = sorted(set(cores) - set(allowed))
        if bad:
            raise FtError(f"CPU MoE cores {bad} are not in this process's allowed cores {allowed}")
        return list(cores)[: threads or len(cores)]
    if threads is None:
        threads = max(1, cpuinfo.physical_cores() - 1)
    if threads < 1:
        raise FtError(f"CPU MoE threads must be at least 1, got {threads}")
    return [allowed[k % len(allowed)] for k in range(threads)]  # more threads than cores: wrap


def name_os_thread(name: str) -> None:
    """Set the kernel's name of the calling thread (/proc/PID/task/TID/comm, 15 chars max)."""
    prctl = getattr(cpuinfo.libc(), "prctl", None)
    if prctl is not None:  # else not Linux: the Python name still holds
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def pin_to_core(core: int) -> None:
    try:
        os.sched_setaffinity(threading.get_native_id(), {core})
    except (AttributeError, OSError) as exc:
        log.warning("CPU MoE worker could not be pinned to core %d: %s", core, exc)


def lower_torch_threads(pool_threads: int) -> tuple[int, int]:
    """Leave torch's intra-op pool only the cores the CPU MoE pool does not take; logs it.

    The engine calls it once, when it builds the pool, from the thread that runs the model
    (torch's count is per thread in its OpenMP build; threads started later inherit it).
    """
    before = torch.get_num_threads()
    after = min(before, max(1, cpuinfo.physical_cores() - pool_threads))
    torch.set_num_threads(after)
    log.info(
        "torch intra-op threads: %d -> %d (cores reserved for the pinned CPU MoE pool)",
        before,
        after,
    )
    return before, after


def format_cores(cores: list[int]) -> str:
    """[0..14] as '0..14'; anything not one ascending run as '0,2,4'."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}..{cores[-1]}"
    return ",".join(map(str, cores))
