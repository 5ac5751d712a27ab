"""The measurer of ft/bisect/measure.py for `ft bisect --ray`: its workers live on Ray nodes
(ft/bisect/cluster.py places them), its samples are compared node by node, and a worker that
loses its node, or cannot install a commit there, carries on elsewhere (the rules are in
cluster.py's docstring)."""

from __future__ import annotations

from collections.abc import Callable

from ft.bisect.cluster import NodeLost, RayWorkers
from ft.bisect.judge import Judge
from ft.bisect.measure import Interrupted, Measurer
from ft.bisect.schedule import NEWER, OLDER
from ft.bisect.store import ANY, Sample, SampleStore
from ft.bisect.verdict import Skip
from ft.errors import FtError


class RayMeasurer(Measurer):
    """The measurer of ft/bisect/measure.py with its workers on Ray nodes: a worker's samples
    are compared by node, and a worker that lost its node carries on elsewhere."""

    def __init__(
        self,
        workers: RayWorkers,
        judge: Judge,
        store: SampleStore,
        log: Callable[[str], None],
        jobs: int,
    ):
        super().__init__(None, store.stack, judge, store, log, None, jobs)  # type: ignore[arg-type]
        self.workers = workers
        self._ends: tuple[str, str, int] | None = None
        self._showing: dict[int, str] = {}  # worker -> what it measures now, for the log

    # --- which samples compare ----------------------------------------------------------------
    def values(self, sha: str, phase: str, worker: int | None = None) -> list[float]:
        """This run's samples (its --jobs) of one worker's node now, or of every node."""
        node = ANY if worker is None else self.workers.key(worker)
        return [
            s["value"]
            for s in self.store.samples(sha, node)
            if s.get("node") and s["phase"] == phase and s["jobs"] == self.jobs
        ]

    def groups(self, a: str, b: str, phase: str) -> list[tuple[list[float], list[float]]]:
        def by_node(sha: str) -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            for s in self.store.samples(sha):
                if s.get("node") and s["phase"] == phase and s["jobs"] == self.jobs:
                    out.setdefault(s["node"], []).append(s["value"])
            return out

        xs, ys = by_node(a), by_node(b)
        return [(xs.get(k, []), ys.get(k, [])) for k in sorted({*xs, *ys})]

    def expect_endpoints(self, good: str, bad: str, n: int) -> None:
        self._ends = (good, bad, n)

    def gpu(self, worker: int) -> str | None:
        return None

    # --- taking a sample ----------------------------------------------------------------------
    def take(
        self,
        sha: str,
        phase: str,
        worker: int,
        tree: int = 0,
        keep: Callable[[], bool] = lambda: True,
    ) -> Skip | None:
        tried: list[str] = []  # nodes where the commit failed to install
        while True:
            if self.stop.is_set():
                raise Interrupted
            self._catch_up(sha, phase, worker)
            self._use_tree(worker, tree)
            if phase == "search":
                self._show(worker, sha)
            with self._lock:
                self.measuring.add(worker)
            try:
                got = self.workers.measure(worker, sha, tree, self.stop)
            except NodeLost as exc:
                if self.stop.is_set():  # Ctrl-C ended the workers: nothing was lost
                    raise Interrupted from None
                lost = self.workers.key(worker)
                gone = self.workers.node_id(worker)
                self.log(f"worker {worker}: node {lost} lost while measuring {sha[:10]} "
                         f"({exc}); sample dropped, worker moves")  # fmt: skip
                self._forget(worker)
                self.workers.move(worker, avoid={gone} if self._is_down(gone) else set())
                self.log(f"worker {worker}: now on node {self.workers.key(worker)}")
                continue
            finally:
                with self._lock:
                    self.measuring.discard(worker)
            if self.stop.is_set():
                raise Interrupted
            node = self.workers.key(worker)
            if "skip" in got:
                self._heads.pop((worker, tree), None)
                reason = f"{got['skip']} (node {node})"
                if got["install"] and self._elsewhere(worker, tried + [node]):
                    tried.append(node)
                    self.log(f"{sha[:10]}: install failed on node {node}; trying another node")
                    continue
                where = f"nodes {', '.join([*tried, node])}" if tried else f"node {node}"
                return Skip(f"{got['skip']} (on {where})" if tried else reason)
            self._heads[(worker, tree)] = (sha, got["applied"])
            if not keep():
                return None
            sample = Sample(got["value"], phase, worker, got["gpu"], got["seconds"], self.jobs,
                            node)  # fmt: skip
            identity = self.workers.identities.get(node)
            self.store.add(sha, sample, got["applied"], got["facts"], identity)
            with self._lock:
                self.taken += 1
            n = len(self.values(sha, phase, worker))
            self.log(f"{sha[:10]} {phase} #{n} on {node}: {got['value']:.6g} (worker {worker})")
            return None

    def _catch_up(self, sha: str, phase: str, worker: int) -> None:
        """A worker on a node without this run's endpoint samples measures them there first:
        a commit is only ever classified against its own node's endpoints."""
        if self._ends is None or phase != "search" or sha in self._ends[:2]:
            return
        good, bad, n = self._ends
        while True:
            behind = [(s, t) for s, t in ((good, OLDER), (bad, NEWER))
                      if len(self.values(s, "search", worker)) < n]  # fmt: skip
            if not behind:
                return
            end, tree = min(behind, key=lambda st: len(self.values(st[0], "search", worker)))
            skip = self.take(end, "search", worker, tree)
            if skip:
                raise FtError(f"endpoint {end[:10]} could not be measured: {skip.reason}")

    def _elsewhere(self, worker: int, tried: list[str]) -> bool:
        """Move the worker to a node not tried yet, if one has room."""
        avoid = {n.node_id for n in self.workers.nodes.values() if n.key in tried}
        try:
            self.workers.move(worker, avoid=avoid)
        except FtError:  # nowhere else to go: the worker stays, the skip stands
            return False
        self._forget(worker)
        return True

    def _is_down(self, node_id: str) -> bool:
        self.workers._refresh()
        return node_id not in self.workers.alive

    def _forget(self, worker: int) -> None:
        """What a worker had checked out died with its actor."""
        for slot in [s for s in self._heads if s[0] == worker]:
            self._heads.pop(slot)
        self._live.pop(worker, None)

    def _show(self, worker: int, sha: str) -> None:
        """Progress: what each node measures, whenever a worker turns to a commit of the
        search (endpoint samples taken between them are not news)."""
        ends = self._ends[:2] if self._ends else ()
        if sha in ends and worker in self._showing or self._showing.get(worker) == sha:
            return
        self._showing[worker] = sha
        label = dict(zip(ends, (" (GOOD)", " (BAD)"), strict=False))  # none before the endpoints
        now = ", ".join(
            f"worker {w}@{self.workers.key(w)}: {s[:10]}{label.get(s, '')}"
            for w, s in sorted(self._showing.items())
        )
        self.log(f"measuring now: {now}")

    # --- the rest of the measurer's duties ----------------------------------------------------
    def _worktree(self, slot):  # the trees live on the nodes
        raise NotImplementedError

    def release(self, slot: tuple[int, int]) -> None:
        if slot in self._heads:
            self.workers.release(*slot)

    def abort(self) -> None:
        self.stop.set()
        self.workers.stop()
