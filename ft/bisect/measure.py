"""Taking samples: a worker's worktrees, its environment (CUDA_VISIBLE_DEVICES), the store.

A worker is one GPU (or one share of the box) with a few clean worktrees ("trees"), so that it
can alternate between commits without checking them out again. Which worker measures what, on
which tree, is decided in ft/bisect/schedule.py; this module takes the samples it is asked for,
and keeps at most one tree of a worker live (engine mode: one server per worker at a time).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ft.bisect.gitrepo import PatchStack, Scratch
from ft.bisect.judge import Judge, kill_active
from ft.bisect.store import Sample, SampleStore
from ft.bisect.verdict import Skip

Slot = tuple[int, int]  # (worker, tree)


class Interrupted(Exception):
    """The run was stopped (Ctrl-C): the sample in flight is dropped, not recorded."""


class Measurer:
    def __init__(
        self,
        scratch: Scratch,
        stack: PatchStack,
        judge: Judge,
        store: SampleStore,
        log: Callable[[str], None],
        gpus: list[str] | None,
        jobs: int = 1,
    ):
        self.scratch, self.stack, self.judge, self.store = scratch, stack, judge, store
        self.log, self.gpus, self.jobs = log, gpus, jobs
        self.taken = 0
        self.stop = threading.Event()
        self.measuring: set[int] = set()  # workers with a measurement in flight
        self.keeps_state = getattr(judge, "keeps_state", True)  # switching commits restarts
        self._heads: dict[Slot, tuple[str, list[str]]] = {}  # slot -> (commit, stack notes)
        self._live: dict[int, int] = {}  # worker -> the tree it measured on last
        self._lock = threading.Lock()

    def env(self, worker: int, sha: str) -> dict[str, str]:
        env = dict(os.environ, FT_BISECT_COMMIT=sha, FT_BISECT_WORKER=str(worker))
        if gpu := self.gpu(worker):
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def gpu(self, worker: int) -> str | None:
        return self.gpus[worker % len(self.gpus)] if self.gpus else None

    def values(self, sha: str, phase: str, worker: int | None = None) -> list[float]:
        """Samples taken under this run's conditions (its --jobs, on this box), of one worker
        or all."""
        return self.store.values(sha, phase, worker=worker, jobs=self.jobs, node=None)

    def groups(self, a: str, b: str, phase: str) -> list[tuple[list[float], list[float]]]:
        """The samples of two commits, condition by condition (a worker here, a node under
        --ray)."""
        return [(self.values(a, phase, w), self.values(b, phase, w)) for w in range(self.jobs)]

    def expect_endpoints(self, good: str, bad: str, n: int) -> None:
        """How many endpoint samples a worker's comparisons rest on now: where a worker can
        move (under --ray, off a node that was lost), it measures them again where it lands."""

    def ensure(self, sha: str, n: int, phase: str, worker: int, tree: int = 0) -> None:
        """At least n samples of this phase by this worker, or a recorded skip."""
        while not self.store.skip_reason(sha) and len(self.values(sha, phase, worker)) < n:
            skip = self.take(sha, phase, worker, tree)
            if skip:
                self.store.mark_skip(sha, skip.reason, worker)

    def take(
        self,
        sha: str,
        phase: str,
        worker: int,
        tree: int = 0,
        keep: Callable[[], bool] = lambda: True,
    ) -> Skip | None:
        """One sample, stored unless `keep()` says otherwise once it is taken."""
        if self.stop.is_set():
            raise Interrupted
        slot = (worker, tree)
        self._use_tree(worker, tree)
        worktree = self._checkout(slot, sha)
        if isinstance(worktree, Skip):
            return worktree
        env = self.env(worker, sha)
        start = time.monotonic()
        with self._lock:
            self.measuring.add(worker)
        try:
            value = self.judge.measure(worktree, env)
        finally:
            with self._lock:
                self.measuring.discard(worker)
        if self.stop.is_set():  # abort() ran while this measured: what it started (a server
            self.release(slot)  # still booting then) is stopped here, or it would outlive ft
            raise Interrupted
        if isinstance(value, Skip) or not keep():
            return value if isinstance(value, Skip) else None
        seconds = round(time.monotonic() - start, 3)
        sample = Sample(value, phase, worker, self.gpu(worker), seconds, self.jobs)
        self.store.add(sha, sample, self._heads[slot][1], self.judge.describe(worktree))
        with self._lock:
            self.taken += 1
        n = len(self.values(sha, phase))
        by = f" (worker {worker})" if self.jobs > 1 else ""
        self.log(f"{sha[:10]} {phase} #{n}: {value:.6g}{by}")
        return None

    def is_measuring(self, workers: set[int]) -> bool:
        with self._lock:
            return bool(self.measuring & workers)

    def head(self, worker: int, tree: int = 0) -> str | None:
        """The commit checked out in that worktree now."""
        return self._heads.get((worker, tree), (None,))[0]

    def live(self, worker: int) -> str | None:
        """The commit the worker measured last (engine mode: its server may still be up)."""
        return self.head(worker, self._live[worker]) if worker in self._live else None

    def _checkout(self, slot: Slot, sha: str) -> Path | Skip:
        path = self._worktree(slot)
        if self.head(*slot) != sha:
            self.release(slot)
            notes = self.scratch.checkout(path, sha, self.stack)
            if isinstance(notes, Skip):
                self._heads.pop(slot, None)
                return notes
            self._heads[slot] = (sha, notes)
        return path

    def _worktree(self, slot: Slot) -> Path:
        worker, tree = slot
        return self.scratch.worktree(f"{worker}" if tree == 0 else f"{worker}-{tree}")

    def _use_tree(self, worker: int, tree: int) -> None:
        """One live tree a worker (its GPU is shared): the one it used last is released."""
        if self._live.get(worker, tree) != tree:
            self.release((worker, self._live[worker]))
        self._live[worker] = tree

    def release(self, slot: Slot) -> None:
        """Let go of what the judge keeps up for that worktree (engine mode: its server)."""
        if slot in self._heads:
            self.judge.release(self._worktree(slot))

    def release_all(self) -> None:
        for slot in list(self._heads):
            self.release(slot)

    def abort(self) -> None:
        self.stop.set()
        kill_active()
        self.release_all()
