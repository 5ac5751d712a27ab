"""Which worker measures what, and when: the one place where measurements are scheduled.

Every comparison rests on one rule: samples that are compared were taken under the same
conditions. A condition is a worker (one GPU, or one share of the box) under one load (--jobs
measurements at once). Two CPU-bound measurements on two cores each run ~45% slower than one
alone, so a commit measured alone would look better than endpoints measured two at a time. So:

- every worker measures both endpoints itself, alternating them, and a commit is classified
  only against the endpoint samples of the worker that measured it (Pinpoint compares on one
  bot; a cluster driver would compare on one node);
- the load stays what it was when the endpoints were measured: while a worker measures a
  commit, a worker with nothing left to do takes more endpoint samples instead of idling;
- a confirmation runs on every worker, each alternating the two commits (asv's interleaved
  A/B runs), so every worker contributes alike to both sides;
- samples taken under another --jobs (an earlier run) are kept but never compared.

    --jobs 2   worker 0:  G B G B | c5 c5 c5           | c2 c2 c2 c2 c2 c2 | ...
               worker 1:  B G B G | c10 c10 c10 G B G | B G B G B G       | ...
                                                ^ done early: keeps the load

With --jobs 1 all of this is one worker measuring one thing at a time. Where switching commits
restarts something (engine mode: a server, with a warm-up), a worker alternates in blocks of
samples instead of one by one. Each worker has a tree for the commit under test and one for
each endpoint (or each commit of a confirmation pair), so alternating checks nothing out.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial

from ft.bisect.measure import Measurer

Task = Callable[[int], None]  # called with the worker that runs it
IDLE_POLL_S = 0.05  # how often a worker with nothing to do looks for a measurement to match
OLDER, NEWER = 1, 2  # a worker's trees for GOOD and BAD, or a pair's two (0: commit under test)


class Scheduler:
    def __init__(
        self,
        measurer: Measurer,
        good: str,
        bad: str,
        jobs: int,
        log: Callable[[str], None] = lambda msg: None,
    ):
        self.measurer, self.good, self.bad, self.jobs, self.log = measurer, good, bad, jobs, log

    @property
    def workers(self) -> range:
        return range(self.jobs)

    def values(self, sha: str, phase: str = "search", worker: int | None = None) -> list[float]:
        return self.measurer.values(sha, phase, worker)

    def references(self, worker: int | None = None) -> tuple[list[float], list[float]]:
        """The endpoint samples that a commit measured by `worker` is compared with (None: the
        samples of every worker, for the report)."""
        return self.values(self.good, worker=worker), self.values(self.bad, worker=worker)

    def measure_endpoints(self, n: int) -> None:
        """n samples of each endpoint on every worker, alternating (odd workers start with BAD,
        so each endpoint is measured beside the other as much as beside itself)."""
        block = n if self.measurer.keeps_state else 1
        self.measurer.expect_endpoints(self.good, self.bad, n)

        def task(worker: int) -> None:
            ends = [(self.good, OLDER), (self.bad, NEWER)][:: 1 if worker % 2 == 0 else -1]
            while not any(self.measurer.store.skip_reason(sha) for sha, _ in ends):
                behind = [
                    (sha, tree) for sha, tree in ends if len(self.values(sha, worker=worker)) < n
                ]
                if not behind:
                    return
                for sha, tree in behind:
                    have = len(self.values(sha, worker=worker))
                    self.measurer.ensure(sha, min(n, have + block), "search", worker, tree)

        self.run_round([task] * self.jobs)

    def judge(self, tasks: list[Task]) -> None:
        """Task k on worker k (at most --jobs of them); the other workers keep the load."""
        self.run_round(tasks)

    def confirm(self, before: str, after: str, n: int) -> str | None:
        """At least n fresh samples of each of the two commits: every worker takes an equal
        share, alternating the two. A worker's two commits share its GPU, so neither stays up
        while the other measures. A failure is returned, not recorded as a skip (the search
        measured these commits)."""
        failed: list[str] = []
        share = -(-n // self.jobs)
        self.measurer.release_all()  # every confirmation sample starts afresh, the first too

        def task(worker: int) -> None:
            while not failed:
                mine = [len(self.values(sha, "confirm", worker)) for sha in (before, after)]
                if min(mine) >= share:
                    return
                sha, tree = (before, OLDER) if mine[0] <= mine[1] else (after, NEWER)
                skip = self.measurer.take(sha, "confirm", worker, tree)
                self.measurer.release((worker, tree))
                if skip:
                    failed.append(f"{sha[:10]}: {skip.reason}")

        self.run_round([task] * self.jobs, keep_load=False)
        return failed[0] if failed else None

    def confirm_samples(self, before: str, after: str) -> tuple[list[float], list[float]]:
        """The confirmation samples of the two commits, comparable across workers: each
        worker's (each node's) scaled by the median of its own samples of both, times the
        median of all of them. Raw figures of unlike workers are never pooled; with one
        worker the samples are returned as they are."""
        groups = [(b, a) for b, a in self.measurer.groups(before, after, "confirm") if b or a]
        if len(groups) <= 1:
            return groups[0] if groups else ([], [])
        overall = statistics.median([x for b, a in groups for x in (*b, *a)])
        scaled_b: list[float] = []
        scaled_a: list[float] = []
        for b, a in groups:
            own = statistics.median([*b, *a])
            scale = overall / own if own else 1.0
            scaled_b += [x * scale for x in b]
            scaled_a += [x * scale for x in a]
        return scaled_b, scaled_a

    def run_round(self, tasks: list[Task], keep_load: bool = True) -> None:
        """Task k on worker k, all at once; with keep_load, every other worker takes endpoint
        samples while a task's worker measures, until every task is done."""
        if not tasks:
            return
        done = threading.Event()
        left = [len(tasks)]
        lock = threading.Lock()
        task_workers = set(range(len(tasks)))

        def work(worker: int) -> None:
            if worker in task_workers:
                try:
                    tasks[worker](worker)
                finally:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            while keep_load and not done.is_set() and not self.measurer.stop.is_set():
                if not self._keep_load(worker, task_workers, done):
                    break

        width = self.jobs if keep_load else len(tasks)
        run_threads([partial(work, w) for w in range(width)], self.measurer.abort)

    def _keep_load(self, worker: int, task_workers: set[int], done: threading.Event) -> bool:
        """One endpoint sample while some task measures; False once that fails."""
        if not self.measurer.is_measuring(task_workers):
            done.wait(IDLE_POLL_S)
            return True
        live = self.measurer.live(worker)  # where switching restarts a server, stay on it
        stay = self.measurer.keeps_state and live in (self.good, self.bad)
        sha = live if stay else self._fewer(worker)
        tree = OLDER if sha == self.good else NEWER
        # a task that ended while this sample ran left it partly alone: it is not stored
        still = partial(self.measurer.is_measuring, task_workers)
        skip = self.measurer.take(sha, "search", worker, tree, keep=still)
        if skip:
            self.log(f"{sha[:10]}: a sample taken to keep the load failed: {skip.reason}")
            return False
        return True

    def _fewer(self, worker: int) -> str:
        return min((self.good, self.bad), key=lambda sha: len(self.values(sha, worker=worker)))


def run_threads(calls: list[Callable[[], None]], on_failure: Callable[[], None]) -> None:
    """Run on worker threads; on Ctrl-C or the first failure, `on_failure` stops the others
    (and kills their commands: samples in flight are dropped, every finished one is on disk)."""
    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="ft-bisect")
    futures = [pool.submit(call) for call in calls]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for fut in futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
    except BaseException:
        on_failure()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
