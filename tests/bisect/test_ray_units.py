"""The --ray measurer's fault rules, against a stand-in for the cluster (no Ray needed): which
node a sample lands on, what a lost node or a failed install costs."""

from __future__ import annotations

from types import SimpleNamespace

from ft.bisect.cluster import NodeLost
from ft.bisect.gitrepo import PatchStack
from ft.bisect.ray_measure import RayMeasurer
from ft.bisect.store import SampleStore
from ft.errors import FtError

GOOD, BAD, COMMIT = "g" * 40, "b" * 40, "c" * 40


class Cluster:
    """Worker 0 on node a; `room`: nodes with room for a worker; `broken`: nodes where every
    install fails; `lose`: how many calls on node a end with the node gone."""

    def __init__(self, room=("b",), broken=(), lose=0):
        self.keys = {0: "a"}
        self.nodes = {n: SimpleNamespace(node_id=n, key=n) for n in "abc"}
        self.alive = set("abc")
        self.room, self.broken, self.lose = list(room), set(broken), lose
        self.identities: dict = {}
        self.calls: list[tuple[str, str]] = []  # (node, commit) of every measurement

    def key(self, worker):
        return self.keys[worker]

    def node_id(self, worker):
        return self.keys[worker]

    def _refresh(self):
        pass

    def measure(self, worker, sha, tree, stop):
        node = self.keys[worker]
        self.calls.append((node, sha))
        if node == "a" and self.lose:
            self.lose -= 1
            self.alive.discard("a")
            raise NodeLost("the node died")
        if node in self.broken:
            return {"skip": "install failed (exit 1): ERROR: no matching distribution",
                    "install": True}  # fmt: skip
        value = {GOOD: 100.0, BAD: 80.0}.get(sha, 90.0)
        return {"value": value, "seconds": 0.1, "applied": [], "facts": {}, "gpu": None}

    def move(self, worker, avoid=frozenset()):
        places = [n for n in self.room if n not in avoid]
        if not places:
            raise FtError("no other node of the cluster has room")
        self.room.remove(places[0])
        self.keys[worker] = places[0]
        return places[0]

    def release(self, worker, tree):
        pass


def _measurer(tmp_path, cluster: Cluster):
    logs: list[str] = []
    store = SampleStore(tmp_path, PatchStack(), {"judge": "test"})
    judge = SimpleNamespace(keeps_state=False)
    return RayMeasurer(cluster, judge, store, logs.append, jobs=1), store, logs


def test_a_lost_node_costs_its_sample_and_the_endpoints_are_measured_where_the_worker_lands(
    tmp_path,
):
    cluster = Cluster(lose=1)
    m, store, logs = _measurer(tmp_path, cluster)
    for sha in (GOOD, BAD):  # measured on a before it went
        store.add(sha, _sample(sha, "a"), [], {})
    m.expect_endpoints(GOOD, BAD, 1)
    assert m.take(COMMIT, "search", 0) is None
    assert cluster.calls == [("a", COMMIT), ("b", GOOD), ("b", BAD), ("b", COMMIT)]
    assert [s["node"] for s in store.samples(COMMIT)] == ["b"]  # nothing of the lost call
    assert m.values(GOOD, "search", 0) == [100.0]  # b's own, a's are not compared with
    assert any("node a lost while measuring" in line for line in logs)


def test_a_failed_install_is_tried_on_another_node_before_the_skip(tmp_path):
    cluster = Cluster(broken={"a"})
    m, store, logs = _measurer(tmp_path, cluster)
    assert m.take(COMMIT, "search", 0) is None
    assert [s["node"] for s in store.samples(COMMIT)] == ["b"]
    assert any("install failed on node a; trying another node" in line for line in logs)

    cluster = Cluster(broken={"a", "b"}, room=("b",))
    m, store, _ = _measurer(tmp_path / "2", cluster)
    skip = m.take(COMMIT, "search", 0)
    assert skip.reason == (
        "install failed (exit 1): ERROR: no matching distribution (on nodes a, b)"
    )
    assert store.samples(COMMIT) == []

    cluster = Cluster(broken={"a"}, room=())  # nowhere else to go: the worker stays
    m, _, _ = _measurer(tmp_path / "3", cluster)
    assert m.take(COMMIT, "search", 0).reason.endswith("(node a)")
    assert cluster.keys[0] == "a"


def _sample(sha: str, node: str):
    from ft.bisect.store import Sample

    return Sample({GOOD: 100.0, BAD: 80.0}[sha] * 2, "search", 0, None, 0.1, 1, node)
