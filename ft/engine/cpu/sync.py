"""How the pool's caller and workers wait for each other inside compiled code: words of an int64
control block, spun on briefly, then slept on with a Linux futex (no GIL held, no core burnt
between calls)."""

from __future__ import annotations

import time
from functools import cache

import numpy as np

from ft.engine.cpu.intrinsics import (
    atomic_add,
    atomic_load,
    atomic_store,
    cycles,
    futex,
    sched_yield,
    spin_pause,
)
from ft.engine.cpu.jit import jit

_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129
# How long a thread spins before it sleeps on the futex, in seconds (counted by the time-stamp
# counter: a pause round takes 10-140 cycles by core, so 20,000 rounds spun ~50 us on one host
# and ~1 ms on another). Where every thread has a core of its own, the workers and the caller
# spin FT_CPU_MOE_SPIN_US (5 ms by default): longer than the gaps between a decode step's layer
# calls, so a call finds its workers awake. Waking 15 sleeping workers took up to 314 us of a
# call on the H200 box's VM (an idle vCPU is woken by the host); kt-kernel's workers spin ~50
# ms. Where the caller shares a core with a worker, the workers spin at most SHORT_SPIN_S (the
# caller's Python needs that core between calls) and the caller SHARED_SPIN_S, as does a worker
# sharing its core with another (more threads than cores): each would slow the thread it
# shares with. A futex wake cost the caller 16-26 us on the 2-core EPYC VM.
SHORT_SPIN_S, SHARED_SPIN_S = 0.0005, 20e-6
# A spinning thread yields its core every YIELD_CYCLES time-stamp cycles (~10 us at 3 GHz): the
# scheduler may still put two of the pool's threads on one core (the unpinned caller beside a
# pinned worker, where some other thread took the caller's free core), and two spinners there
# each wait out the other's whole slice: 650 us -> 7,964 us a bf16 call on the 2-core EPYC VM,
# 7.8 ms against ~100 us in the first cells of runs on the 15-thread H100 and H200 boxes. On a
# core of its own a yield returns at once (~0.5 us, a state change seen that much later).
YIELD_CYCLES = 30_000
CALIBRATE_S = 0.02


@jit()
def read_cycles():
    return cycles()


@cache
def cycles_per_second() -> float:
    """The time-stamp counter's rate, against perf_counter over CALIBRATE_S (an invariant TSC,
    as every x86 host since ~2008 and its VMs have: the same rate on every core)."""
    c0, t0 = read_cycles(), time.perf_counter()
    while time.perf_counter() - t0 < CALIBRATE_S:
        pass
    return (read_cycles() - c0) / (time.perf_counter() - t0)


def spin_cycles(seconds: float) -> int:
    """`seconds` of spinning in time-stamp counter cycles (wait_change's `spin`)."""
    return int(seconds * cycles_per_second())


@jit()
def futex_wait(ctrl, i, seen):
    """Sleep while ctrl[i]'s low 32 bits equal `seen` (returns at once if they differ)."""
    futex(ctrl.ctypes.data + i * 8, _FUTEX_WAIT_PRIVATE, seen & 0xFFFFFFFF)


@jit()
def futex_wake(ctrl, i):
    """Wake every thread sleeping in futex_wait(ctrl, i, ...)."""
    futex(ctrl.ctypes.data + i * 8, _FUTEX_WAKE_PRIVATE, 1 << 30)


@jit()
def wait_change(ctrl, i, seen, sleepers, spin):
    """Return ctrl[i] once it differs from `seen`: spin for `spin` time-stamp counter cycles
    (spin_cycles), then sleep on the futex, counted in ctrl[sleepers] so the writer wakes only
    when someone sleeps."""
    start = last_yield = cycles()
    while True:
        now = atomic_load(ctrl, i)
        if now != seen:
            return now
        at = cycles()
        if at - start > spin:
            break
        if at - last_yield > YIELD_CYCLES:
            sched_yield()
            last_yield = at
        spin_pause()
    while True:
        atomic_add(ctrl, sleepers, 1)
        now = atomic_load(ctrl, i)
        if now == seen:
            futex_wait(ctrl, i, seen)
        atomic_add(ctrl, sleepers, -1)
        now = atomic_load(ctrl, i)
        if now != seen:
            return now


@jit()
def publish(ctrl, i, value, sleepers):
    """ctrl[i] = value, and wake the threads sleeping on it if there are any."""
    atomic_store(ctrl, i, value)
    wake(ctrl, i, sleepers)


@jit()
def wake(ctrl, i, sleepers):
    """Wake the threads sleeping on ctrl[i] if wait_change counted any in ctrl[sleepers]
    (call it after the write they wait for: a locked add or a sequentially consistent store)."""
    if atomic_load(ctrl, sleepers) > 0:
        futex_wake(ctrl, i)


def control_block(words: int) -> np.ndarray:
    """A zeroed int64 array of `words` words, word w at index 8 * w: each on its own cache line
    (no false sharing between the caller's writes and the workers' counters)."""
    return np.zeros(words * 8, np.int64)
