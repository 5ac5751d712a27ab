"""`ft bisect --ray ADDRESS`: the workers of ft/bisect/schedule.py live on a Ray cluster.

Ray places the workers and moves the code; ft keeps the search, the statistics, the store and
the report. A worker is an actor on one node (ft/bisect/ray_node.py) holding one measurement's
resources (a GPU in engine mode, --cpus-per-job cores with --run); --jobs workers are spread over
the nodes, one per node before two on any. The fairness rule is the local one with the node as
the condition: a node measures both endpoints itself and a commit is classified only against the
endpoint samples of the node that measured it; confirmation samples are scaled node by node
before they are pooled (Scheduler.confirm_samples). Raw figures of two nodes are never pooled.

Faults:
- a node (or a worker's process) lost during a measurement costs that sample: the worker starts
  again on its node if it is still there, else on another node with room, measures the endpoints
  there first if that node has none of its own yet, and takes the sample again;
- a commit whose environment fails to install on one node is tried on another node with room
  before it is skipped; the reason names the node;
- the store is the driver's, so a driver killed with kill -9 resumes (`--resume`) from it:
  samples are keyed by node, and a node keeps its key while the cluster is up.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ft.bisect.gitrepo import PatchStack, Scratch
from ft.bisect.judge import Judge
from ft.bisect.measure import Interrupted, Measurer
from ft.bisect.schedule import NEWER, OLDER
from ft.bisect.store import ANY, Sample, SampleStore
from ft.bisect.verdict import Skip
from ft.errors import FtError
from ft.report import plural

RAY_MISSING = "--ray needs Ray: pip install 'freetoken[ray]'"
WAIT_S = 0.25  # how often a worker waiting on its node looks for Ctrl-C
STOP_WAIT_S = 10.0  # how long a stopping worker gets to end its commands before it is killed
CONNECT_S = 10.0  # how long the cluster's address may take to answer at all
START_S = 300.0  # how long a worker may wait for its node's resources (another job holds them)


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise FtError(RAY_MISSING)


def check_reachable(address: str) -> None:
    """A `host:port` or `ray://host:port` where nothing answers is an error at once (ray.init
    would retry for minutes); `local` and `auto` are Ray's to resolve."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address in ("local", "auto") or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise FtError(f"cannot reach the Ray cluster at {address}: {why}") from None


class NodeLost(Exception):
    """The worker's node, or its process, went away during a call."""


@dataclass(frozen=True)
class Node:
    node_id: str
    key: str  # the name samples carry: the hostname, with the node id where hosts repeat
    host: str
    resources: dict[str, float]


class RayWorkers:
    """--jobs actors on the cluster at ADDRESS, and the calls the measurer makes to them."""

    def __init__(
        self,
        address: str,
        opts: Any,  # driver.BisectOptions
        scratch: Scratch,
        stack: PatchStack,
        shas: list[str],
        log: Callable[[str], None],
    ):
        import ray

        self.ray, self.address, self.opts, self.log = ray, address, opts, log
        self.gpus = opts.run is None  # engine mode: a GPU a measurement, where there are any
        self.jobs = opts.search.jobs
        local = {"include_dashboard": False} if address == "local" else {}
        check_reachable(address)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, **local)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise FtError(f"cannot reach the Ray cluster at {address}: {first}") from None
        self._lock = threading.Lock()
        self._moving = threading.RLock()  # two workers that lose nodes at once take two places
        self.nodes: dict[str, Node] = {}
        self.identities: dict[str, dict[str, Any]] = {}  # node key -> who measures there
        self.actors: dict[int, Any] = {}
        self.where: dict[int, str] = {}  # worker -> node id, while its actor is up
        self.keys: dict[int, str] = {}  # worker -> the key of its node (the last one, mid-move)
        try:
            self._place(scratch, stack, shas)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, scratch: Scratch, stack: PatchStack, shas: list[str]) -> None:
        ray = self.ray
        self._refresh()
        if self.gpus and not any(self.nodes[i].resources.get("GPU") for i in self.alive):
            self.gpus = False  # a CPU cluster: the engine runs on --cpus-per-job CPUs
            self.log(f"the cluster has no GPU: each measurement holds {self.per_job()}")
        bundle = scratch.bundle(shas, scratch.root / "ray" / "range.bundle")
        data = bundle.read_bytes()
        self.bundle_bytes = len(data)
        self._args = (
            ray.put(data),
            hashlib.sha256("\n".join(shas).encode()).hexdigest()[:12],
            # this run's trees: apart from another driver's run (its out dir) or patch stack
            hashlib.sha256(f"{scratch.root.resolve()} {stack.digest()}".encode()).hexdigest()[:12],
            shas[0],
            stack.picks,
            [(p.name, p.read_bytes()) for p in stack.patches],
            self.opts,
            os.environ.get("OMP_NUM_THREADS"),
        )
        slots = self._slots()
        if len(slots) < self.jobs:
            raise FtError(
                f"--jobs {self.jobs} needs room for {plural(self.jobs, 'measurement')}; the "
                f"cluster at {self.address} has room for {len(slots)} ({self.per_job()} each)"
            )
        self._start({worker: slots[worker] for worker in range(self.jobs)})

    # --- where workers go -------------------------------------------------------------------
    def per_job(self) -> str:
        cpus = self.opts.cpus_per_job
        return "1 GPU" if self.gpus else plural(int(cpus) if cpus == int(cpus) else cpus, "CPU")

    def _capacity(self, node: Node) -> int:
        if self.gpus:
            return int(node.resources.get("GPU", 0))
        return int(node.resources.get("CPU", 0) // self.opts.cpus_per_job)

    def _refresh(self) -> None:
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        hosts = [n["NodeManagerHostname"] for n in alive]
        for n in alive:
            host = n["NodeManagerHostname"]
            key = host if hosts.count(host) == 1 else f"{host}-{n['NodeID'][:6]}"
            if n["NodeID"] not in self.nodes:
                self.nodes[n["NodeID"]] = Node(n["NodeID"], key, host, dict(n["Resources"]))
        self.alive = {n["NodeID"] for n in alive}

    def _slots(self, exclude_worker: int | None = None) -> list[str]:
        """Free places, one per node before a second on any (nodes in key order)."""
        used = {w: n for w, n in self.where.items() if w != exclude_worker}
        nodes = sorted((self.nodes[i] for i in self.alive), key=lambda n: n.key)
        free = {n.node_id: self._capacity(n) - list(used.values()).count(n.node_id) for n in nodes}
        slots: list[str] = []
        for turn in range(max(free.values(), default=0)):
            slots += [n.node_id for n in nodes if free[n.node_id] > turn]
        return slots

    def _start(self, places: dict[int, str]) -> None:
        """Start workers on nodes (worker -> node id), all at once: each is a new process."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ft.bisect.ray_node import NodeWorker

        resources = {"num_gpus": 1, "num_cpus": 0} if self.gpus else {
            "num_cpus": self.opts.cpus_per_job}  # fmt: skip
        actors = {}
        for worker, node_id in places.items():
            cls = self.ray.remote(NodeWorker).options(
                **resources,
                max_restarts=0,
                max_concurrency=2,  # stop() runs beside a measurement
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            actors[worker] = cls.remote(self.nodes[node_id].key, worker, *self._args)
        deadline = time.monotonic() + START_S
        for worker, actor in actors.items():
            node = self.nodes[places[worker]]
            identity = self._call(actor, "identity", deadline=deadline)
            if identity is None:
                raise FtError(
                    f"worker {worker} found no room on node {node.key} for {START_S:g} s "
                    f"({self.per_job()}): does another job hold it?"
                )
            with self._lock:
                self.actors[worker], self.where[worker] = actor, node.node_id
                self.keys[worker] = node.key
                self.identities[node.key] = {"key": node.key, **identity}

    def move(self, worker: int, avoid: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        """Start the worker again: on its node while that is up (and not avoided), else on the
        node with the most room. The new node's key, or FtError where none has room."""
        with self._moving:
            old = self.where.get(worker)
            self._refresh()
            slots = [n for n in self._slots(exclude_worker=worker) if n not in avoid]
            if not slots:
                raise FtError(f"no other node of the cluster has room for worker {worker} "
                              f"({self.per_job()})")  # fmt: skip
            target = old if old in slots else slots[0]
            self._kill(worker)
            with self._lock:
                self.where.pop(worker, None)
            try:
                self._start({worker: target})
            except NodeLost:
                return self.move(worker, avoid | {target})
            return self.key(worker)

    def _kill(self, worker: int) -> None:
        actor = self.actors.pop(worker, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)

    # --- calls --------------------------------------------------------------------------------
    def key(self, worker: int) -> str:
        return self.keys[worker]

    def node_id(self, worker: int) -> str:
        return self.where[worker]

    def measure(self, worker: int, sha: str, tree: int, stop: threading.Event) -> dict:
        return self._call(self.actors[worker], "measure", sha, tree, stop=stop)

    def release(self, worker: int, tree: int) -> None:
        if worker in self.actors:
            try:
                self._call(self.actors[worker], "release", tree)
            except NodeLost:
                pass  # nothing left there to release

    def _call(
        self,
        actor: Any,
        method: str,
        *args: Any,
        stop: threading.Event | None = None,
        deadline: float | None = None,
    ) -> Any:
        """The call's result; Interrupted once `stop` is set; None past `deadline`."""
        from ray.exceptions import GetTimeoutError, RayError, RayTaskError

        ref = getattr(actor, method).remote(*args)
        while True:
            try:
                return self.ray.get(ref, timeout=WAIT_S)
            except GetTimeoutError:
                if stop is not None and stop.is_set():
                    raise Interrupted from None
                if deadline is not None and time.monotonic() > deadline:
                    return None
            except RayTaskError as exc:  # ft's own code failed there: a bug, shown as one
                raise exc.as_instanceof_cause() from None
            except RayError as exc:  # the actor or its node is gone
                raise NodeLost(str(exc).strip().splitlines()[0][:200]) from None

    def stop(self) -> None:
        """Ctrl-C: every worker ends its commands and servers, then goes."""
        refs = [a.stop.remote() for a in self.actors.values()]
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
        finally:
            for worker in list(self.actors):
                self._kill(worker)

    def shutdown(self) -> None:
        for worker in list(self.actors):
            self._kill(worker)
        self.ray.shutdown()

    def describe(self) -> dict[str, Any]:
        """The cluster, for the report: Ray's version, the nodes, who measured where."""
        nodes = sorted(self.nodes.values(), key=lambda n: n.key)
        return {
            "address": self.address,
            "ray": self.ray.__version__,
            "per_job": self.per_job(),
            "bundle_bytes": self.bundle_bytes,
            "nodes": [
                {
                    "key": n.key,
                    "host": n.host,
                    "alive": n.node_id in self.alive,
                    "cpus": n.resources.get("CPU", 0),
                    "gpus": n.resources.get("GPU", 0),
                    **self.identities.get(n.key, {}),
                }
                for n in nodes
            ],
            "gpus": sum(n.resources.get("GPU", 0) for n in nodes if n.node_id in self.alive),
            "workers": {str(w): self.key(w) for w in sorted(self.keys)},
        }


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
            if self._live.get(worker, tree) != tree:  # one live tree a worker, as locally
                self.release((worker, self._live[worker]))
            self._live[worker] = tree
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
