"""Taking samples: worker slots (one clean worktree each), their environment, the store."""

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
    ):
        self.scratch, self.stack, self.judge, self.store = scratch, stack, judge, store
        self.log, self.gpus = log, gpus
        self.taken = 0
        self.stop = threading.Event()
        self._heads: dict[int, tuple[str, list[str]]] = {}  # slot -> (commit, stack notes)
        self._lock = threading.Lock()

    def env(self, slot: int, sha: str) -> dict[str, str]:
        env = dict(os.environ, FT_BISECT_COMMIT=sha, FT_BISECT_WORKER=str(slot))
        if gpu := self._gpu(slot):
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def _gpu(self, slot: int) -> str | None:
        return self.gpus[slot % len(self.gpus)] if self.gpus else None

    def ensure(self, sha: str, n: int, phase: str, slot: int) -> None:
        """At least n samples of this phase for `sha`, or a recorded skip."""
        while not self.store.skip_reason(sha) and len(self.store.values(sha, phase)) < n:
            skip = self.take(sha, phase, slot)
            if skip:
                self.store.mark_skip(sha, skip.reason, slot)
                self.log(f"{sha[:10]}: skip ({skip.reason})")

    def take(self, sha: str, phase: str, slot: int) -> Skip | None:
        if self.stop.is_set():
            raise Interrupted
        worktree = self._checkout(slot, sha)
        if isinstance(worktree, Skip):
            return worktree
        env = self.env(slot, sha)
        start = time.monotonic()
        value = self.judge.measure(worktree, env)
        if self.stop.is_set():  # abort() ran while this measured: what it started (a server
            self.release(slot)  # still booting then) is stopped here, or it would outlive ft
            raise Interrupted
        if isinstance(value, Skip):
            return value
        sample = Sample(value, phase, slot, self._gpu(slot), round(time.monotonic() - start, 3))
        self.store.add(sha, sample, self._heads[slot][1], self.judge.describe(worktree))
        with self._lock:
            self.taken += 1
        n = len(self.store.values(sha, phase))
        self.log(f"{sha[:10]} {phase} #{n}: {value:.6g} (worker {slot})")
        return None

    def _checkout(self, slot: int, sha: str) -> Path | Skip:
        path = self.scratch.worktree(slot)
        if self._heads.get(slot, ("",))[0] != sha:
            self.release(slot)
            notes = self.scratch.checkout(path, sha, self.stack)
            if isinstance(notes, Skip):
                self._heads.pop(slot, None)
                return notes
            self._heads[slot] = (sha, notes)
        return path

    def release(self, slot: int) -> None:
        if slot in self._heads:
            self.judge.release(self.scratch.worktree(slot))

    def interleave(self, before: str, after: str, n: int) -> str | None:
        """Confirmation: n fresh samples of each, alternating. Where both slots share a device
        each sample starts afresh (the two cannot be up at once on one GPU); with a device
        each, both stay up and samples alternate between them. A failure here is reported,
        not recorded as a skip (the search already measured these commits)."""
        shared = self._gpu(0) == self._gpu(1)
        try:
            while True:
                nb = len(self.store.values(before, "confirm"))
                na = len(self.store.values(after, "confirm"))
                if nb >= n and na >= n:
                    return None
                sha, slot = (before, 0) if nb <= na else (after, 1)
                skip = self.take(sha, "confirm", slot)
                if shared:
                    self.release(slot)
                if skip:
                    return f"{sha[:10]}: {skip.reason}"
        finally:
            self.release(0)
            self.release(1)

    def abort(self) -> None:
        self.stop.set()
        kill_active()
        for slot in list(self._heads):
            self.release(slot)
