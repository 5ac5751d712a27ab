"""Where a layer call's time goes, from the time-stamp counter read by the caller and by each
worker at each point of its share (layer_kernel's STAMPS): `ft bench cpu-moe --phases`.

Per worker:
  wake     the caller's publish to the worker's start (spinning: ~0; asleep: the futex wake)
  prep     its copies of x quantised or rounded for the call's dot
  phase 1  its rows of every expert's gate and up
  barrier  its wait for the slowest worker's phase 1
  phase 2  its rows of every expert's down projection
and per call:
  return   the last worker done to the caller's wait seeing it
  total    the caller's publish to its wait seeing the call done
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ft.engine.cpu import layer_kernel as K
from ft.engine.cpu.sync import cycles_per_second

WORKER_PHASES = ("wake", "prep", "phase 1", "barrier", "phase 2")
# each worker phase runs from one stamp to the next: (from, to), the caller's publish as None
_SPANS = {
    "wake": (None, K.STARTED),
    "prep": (K.STARTED, K.PREPARED),
    "phase 1": (K.PREPARED, K.ARRIVED),
    "barrier": (K.ARRIVED, K.PASSED),
    "phase 2": (K.PASSED, K.FINISHED),
}


@dataclass(frozen=True)
class CallPhases:
    """One call: each worker phase's seconds per worker, the return and the total."""

    workers: dict[str, np.ndarray]  # phase -> [workers] seconds
    returned_s: float
    total_s: float

    @classmethod
    def of(cls, stamps: np.ndarray, published: int, returned: int) -> CallPhases:
        """From the workers' stamps [workers, STAMP_COUNT] and the caller's publish and return
        (time-stamp counter values)."""
        hz = cycles_per_second()
        workers = {}
        for name, (start, end) in _SPANS.items():
            begin = published if start is None else stamps[:, start]
            workers[name] = (stamps[:, end] - begin) / hz
        return cls(workers, (returned - stamps[:, K.FINISHED].max()) / hz,
                   (returned - published) / hz)  # fmt: skip


def summarize(calls: list[CallPhases]) -> dict:
    """A cell's calls: per worker phase, the median over calls of the median worker's and of
    the slowest worker's microseconds, and each worker's median phase 1 (which ones are slow:
    a core shared with the caller or a hyperthread sibling, say); return and total, medians."""
    out = {}
    for name in WORKER_PHASES:
        per_call = [c.workers[name] for c in calls]
        out[name] = dict(
            median_us=_us(statistics.median(float(np.median(w)) for w in per_call)),
            max_us=_us(statistics.median(float(w.max()) for w in per_call)),
        )
    out["return"] = dict(median_us=_us(statistics.median(c.returned_s for c in calls)))
    out["total"] = dict(median_us=_us(statistics.median(c.total_s for c in calls)))
    phase1 = np.median(np.stack([c.workers["phase 1"] for c in calls]), axis=0)
    out["phase 1 by worker_us"] = [_us(v) for v in phase1]
    return out


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 1)
