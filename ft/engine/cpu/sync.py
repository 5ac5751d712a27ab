"""How the pool's caller and workers wait for each other inside compiled code: words of an int64
control block, spun on briefly, then slept on with a Linux futex (no GIL held, no core burnt
between calls)."""

from __future__ import annotations

import numpy as np

from ft.engine.cpu.intrinsics import atomic_add, atomic_load, atomic_store, futex, spin_pause
from ft.engine.cpu.jit import jit

_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129
# pause rounds before sleeping: a thread on a core of its own (a worker; the caller where the
# workers leave it one) spins ~0.4-1 ms, longer than a decode layer's gap between calls and than
# most calls; a caller sharing a core with a worker hardly spins at all, so as not to slow it.
# A futex wake cost the caller 16-26 us on the 2-core EPYC VM (pool of one thread, k=1-2 calls
# of 0.4-0.9 ms), spinning 0.3 us once a call ended inside the spin.
SPIN, SHARED_SPIN = 20_000, 100


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
    """Return ctrl[i] once it differs from `seen`: spin `spin` pauses, then sleep on the
    futex, counted in ctrl[sleepers] so the writer wakes only when someone sleeps."""
    for _ in range(spin):
        now = atomic_load(ctrl, i)
        if now != seen:
            return now
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


@jit()
def arrive(ctrl, i, target, sleepers):
    """Count this thread in ctrl[i] (a counter that only grows) and return once it reaches
    `target`; the thread that reaches it wakes the sleepers."""
    now = atomic_add(ctrl, i, 1) + 1
    if now == target:
        wake(ctrl, i, sleepers)
        return
    while now < target:
        now = wait_change(ctrl, i, now, sleepers, SPIN)


def control_block(words: int) -> np.ndarray:
    """A zeroed int64 array of `words` words, word w at index 8 * w: each on its own cache line
    (no false sharing between the caller's writes and the workers' counters)."""
    return np.zeros(words * 8, np.int64)
