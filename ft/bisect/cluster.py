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
from ft.bisect.measure import Interrupted
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
