"""The /proc thread probe on a real child process, its parsers, and role classification."""

import os
import subprocess
import sys
import time

import pytest

from ft.probes import threads
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def busy_child():
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/assets/busy_main.py")])
    yield proc
    proc.kill()
    proc.wait()


def test_probe_sees_the_spinning_main_thread_and_the_pool(busy_child):
    probe = threads.ThreadProbe(busy_child.pid)
    deadline = time.monotonic() + 20
    while len(probe.sample()["threads"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    rec = probe.sample()
    main = next(t for t in rec["threads"] if t["tid"] == busy_child.pid)
    assert main["state"] == "R" and main["cpu_pct"] + main["delay_pct"] > 50  # a busy box delays it
    others = [t for t in rec["threads"] if t["tid"] != busy_child.pid]
    assert len(others) == 3 and all(t["cpu_pct"] < 20 for t in others)
    assert main["cpus_allowed"] and main["voluntary_ctxt"] >= 0


def test_parse_stat_with_a_hostile_comm():
    text = "42 (a) b (c) R " + " ".join(["1"] * 10) + " 250 50 0 0"  # fields 4-13, utime, stime
    comm, state, utime, stime = threads._parse_stat(text)
    assert (comm, state) == ("a) b (c", "R")
    assert utime == 250 / threads.CLK_TCK and stime == 50 / threads.CLK_TCK


def test_vanished_threads_and_processes_read_as_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert threads.read_thread(proc.pid, proc.pid) is None
    assert threads.sample_tree(proc.pid) == []
    assert threads.ThreadProbe(proc.pid).sample()["threads"] == []


def test_roles_from_os_and_python_names():
    rec = {"pid": 10, "tid": 11, "comm": "python"}
    assert threads.classify({**rec, "tid": 10}, "MainThread", "python", True) == threads.MAIN
    assert threads.classify(rec, "ft-cpu-moe-3", "python", True) == threads.POOL
    assert threads.classify({**rec, "comm": "ft-cpu-moe-0"}, None, "python", True) == threads.POOL
    assert threads.classify(rec, "ft-engine", "python", True) == threads.ENGINE
    assert threads.classify(rec, "AnyIO worker thread", "python", True) == threads.SERVER
    assert threads.classify(rec, None, "python", True) == threads.TORCH
    assert threads.classify(rec, None, "python", False) == threads.OTHER
    assert threads.classify(rec, "Thread-1", "python", True) == threads.OTHER


def test_process_tree_finds_children_and_grandchildren():
    from ft.probes.threads import process_tree

    proc = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & wait) & wait"])
    try:
        deadline = time.monotonic() + 20
        while len(process_tree(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        assert tree[0] == proc.pid and len(set(tree)) == 4
    finally:
        for pid in reversed(process_tree(proc.pid)):
            os.kill(pid, 9)
        proc.wait()
    assert process_tree(proc.pid) == []
