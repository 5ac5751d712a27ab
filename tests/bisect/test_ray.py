"""`ft bisect --ray`: one bisect over a Ray cluster (here three nodes of one box, one CPU each),
comparisons held to one node, and the faults a cluster has: a node lost, the driver killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bisect.helpers import Project, culprit, make_project, result, step
from tests.conftest import ft_env, run_ft

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20}

# The figure: figure.txt, times this node's scale (argv[3], JSON {node: scale}); "cpu" (argv[2])
# times a loop of figure.txt thousand turns instead, in units of a 100-thousand-turn loop timed
# beside it: a shared VM's speed moves up to 2x for seconds at a time (measured), which no
# bisect can tell from a regression. The log (argv[1]) gets a line as a measurement starts and
# one as it ends: "start|end NODE COMMIT".
MEASURE = r"""
import json, os, pathlib, random, sys, time
log, kind = pathlib.Path(sys.argv[1]), sys.argv[2]
scales = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
node, commit = os.environ.get("FT_TEST_NODE", "local"), os.environ["FT_BISECT_COMMIT"]
with log.open("a") as f:
    f.write(f"start {node} {commit}\n")
figure = float(pathlib.Path("figure.txt").read_text())
def loop(turns):
    start, x = time.perf_counter(), 0
    for i in range(turns):
        x += i
    return time.perf_counter() - start
if kind == "cpu":
    unit = loop(100_000)
    work = loop(int(figure * 1000))
    value = work / ((unit + loop(100_000)) / 2)
else:
    time.sleep(0.15)
    value = figure * (1 + random.Random(f"{commit}-{time.time()}").gauss(0, 0.02))
with log.open("a") as f:
    f.write(f"end {node} {commit}\n")
print(value * scales.get(node, 1.0))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Nodes a (the head), b and c: one CPU each, so one measurement each."""
    cache = str(tmp_path_factory.mktemp("ray-nodes-cache"))

    def args(name: str) -> dict:
        return {**NODE_ARGS, "env_vars": {"FT_TEST_NODE": name, "FT_CACHE_DIR": cache}}

    c = cluster_utils.Cluster(initialize_head=True, head_node_args=args("a"))
    c.names = {c.head_node.node_id: "a"}
    for name in "bc":
        c.names[c.add_node(**args(name)).node_id] = name
    c.wait_for_nodes()
    c.args = args
    yield c
    c.shutdown()


def _project(tmp_path: Path, figures: list[float], kind: str, scales=None) -> Project:
    p = make_project(tmp_path, figures)
    p.script.write_text(MEASURE)
    scale = f" '{json.dumps(scales)}'" if scales else ""
    p.cmd_text = f"{sys.executable} {p.script} {p.counter} {kind}{scale}"
    return p


def _args(p: Project, out: str, *extra: str) -> list[str]:
    return ["bisect", f"{p.shas[0]}..{p.shas[-1]}", "--repo", str(p.repo), "--run",
            p.cmd_text, "--out", str(p.repo.parent / out), "--json", *extra]  # fmt: skip


def _log(p: Project) -> list[list[str]]:
    return [ln.split() for ln in p.counter.read_text().splitlines()] if p.counter.exists() else []


def _stored(out: Path) -> list[dict]:
    return [s for f in (out / "samples").iterdir() for s in json.loads(f.read_text())["samples"]]


def _placement(cluster) -> list[str]:
    """The nodes in the order workers fill them (one per node, by key: host and node id)."""
    return [cluster.names[i] for i in sorted(cluster.names, key=lambda i: i[:6])]


def test_ray_names_the_culprit_that_jobs_1_names_without_ray(cluster, tmp_path):
    """A CPU-bound figure (3x at commit 5), two runs each way: the same commit every time."""
    p = _project(tmp_path, step(8, 5, 500.0, 1500.0), "cpu")
    for k in range(2):
        local = result(run_ft(*_args(p, f"local-{k}"), timeout=240))
        assert culprit(local) == p.shas[5], k
    for k in range(2):
        rep = result(run_ft(*_args(p, f"ray-{k}", "--ray", cluster.address, "-j", "2"),
                            timeout=240))  # fmt: skip
        assert culprit(rep) == p.shas[5], k
    assert rep["cluster"]["ray"] == ray.__version__
    assert {n["key"] for n in rep["nodes"]} == set(rep["cluster"]["workers"].values())
    assert len(rep["nodes"]) == 2 and all(n["n_good"] >= 6 for n in rep["nodes"])
    md = (Path(rep["out"]) / "report.md").read_text()
    assert f"Ray {ray.__version__} cluster" in md and "GOOD median" in md


def test_unlike_nodes_are_never_pooled(cluster, tmp_path):
    """The node that measures commit 3 (GOOD-like) reads every figure at half: against that
    node's own endpoints it is good; against every node's endpoints pooled, its median lies
    beyond BAD's, so a pooled search could never call it good, nor name commit 6."""
    from ft.bisect.stats import classify, median, position
    from ft.bisect.verdict import Verdict

    slow = _placement(cluster)[0]  # worker 0: it takes the first cut, commit 3 of 0..9
    p = _project(tmp_path, step(10, 6), "fixed", {slow: 0.5})
    rep = result(run_ft(*_args(p, "out", "--ray", cluster.address, "-j", "3"), timeout=240))
    assert culprit(rep) == p.shas[6]
    rows = {r["sha"]: r for r in rep["commits"]}
    halved = [n for n in rep["nodes"] if n["good"] < 70]
    assert len(halved) == 1 and halved[0]["bad"] < 45  # both its endpoints read half
    key = halved[0]["key"]
    third = rows[p.shas[3]]
    assert set(third["nodes"]) == {key} and third["verdict"] == "good"

    def search(sha: str, node: str | None = None) -> list[float]:
        return [s["value"] for s in rows[sha]["samples"]
                if s["phase"] == "search" and node in (None, s["node"])]  # fmt: skip

    own = classify(search(p.shas[3]), search(p.shas[0], key), search(p.shas[-1], key))
    assert own.verdict == Verdict.GOOD
    good, bad = search(p.shas[0]), search(p.shas[-1])
    assert classify(search(p.shas[3]), good, bad).verdict != Verdict.GOOD
    assert position(median(search(p.shas[3])), median(good), median(bad)) > 1


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ft", *args], env=ft_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _wait(what, proc: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return found


def test_a_killed_driver_resumes_without_measuring_again(cluster, tmp_path):
    p = _project(tmp_path, step(12, 7), "fixed")
    out = tmp_path / "out"
    first = _start(_args(p, "out", "--ray", cluster.address, "-j", "2"))
    _wait(lambda: len([ln for ln in _log(p) if ln[0] == "end"]) >= 12, first)
    os.kill(first.pid, signal.SIGKILL)  # kill -9
    first.communicate(timeout=60)
    time.sleep(1.0)  # the cluster ends the dead driver's workers (a command in flight ends)
    kept = _stored(out)
    ended = len([ln for ln in _log(p) if ln[0] == "end"])
    assert len(kept) >= 10 and ended - len(kept) <= 2  # lost: the two samples in flight

    resumed = result(run_ft("bisect", "--resume", "--out", str(out), "--json", timeout=240))
    assert culprit(resumed) == p.shas[7]
    after = _stored(out)
    assert all(s in after for s in kept)  # every sample kept, and read back, not measured
    assert len(after) == len(kept) + resumed["samples_taken"]


def test_a_node_removed_mid_run_costs_only_its_sample(cluster, tmp_path):
    """Node d joins, takes a worker, and is removed while it measures: its worker moves to
    the node left free and the run ends as it should; no sample of the lost one is stored."""
    d = cluster.add_node(**cluster.args("d"))
    cluster.wait_for_nodes()
    cluster.names[d.node_id] = "d"
    try:
        p = _project(tmp_path, step(12, 7), "fixed")
        proc = _start(_args(p, "out", "--ray", cluster.address, "-j", "3"))
        spare = _placement(cluster)[3]  # three workers on four nodes: this one stays free
        # d if it takes a worker, else a worker's node other than the head (a cluster's head
        # cannot be removed)
        victim = next(n for n in ["d", *_placement(cluster)] if n not in (spare, "a"))
        node = next(n for n in cluster.list_all_nodes() if cluster.names[n.node_id] == victim)
        assert node is not cluster.head_node

        def busy() -> bool:  # the victim is in a measurement after its endpoints
            started = [ln for ln in _log(p) if ln[1] == victim]
            return len(started) >= 6 and started[-1][0] == "start"

        _wait(busy, proc)
        cluster.remove_node(node)
        out, err = proc.communicate(timeout=240)
    finally:
        if d in cluster.list_all_nodes():
            cluster.remove_node(d)
    assert proc.returncode == 0, err[-3000:]
    rep = json.loads(out)
    assert culprit(rep) == p.shas[7]
    assert "lost while measuring" in err and "now on node" in err
    mine = [s for s in _stored(tmp_path / "out") if s["node"] == victim_key(rep, cluster, victim)]
    ended = [ln for ln in _log(p) if ln[:2] == ["end", victim]]
    assert len(mine) <= len(ended)  # the sample cut short is not stored
    assert spare in {cluster.names[n["node_id"]] for n in rep["cluster"]["nodes"]
                     if n.get("node_id")}  # fmt: skip


def victim_key(rep: dict, cluster, name: str) -> str:
    return next(n["key"] for n in rep["cluster"]["nodes"]
                if n.get("node_id") and cluster.names[n["node_id"]] == name)  # fmt: skip
