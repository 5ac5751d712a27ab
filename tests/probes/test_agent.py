"""The in-process stack agent: injected through the environment, flushed, chained, harmless."""

import json
import os
import subprocess
import sys
import time

import pytest

from ft.probes.agent_session import AgentSession
from ft.probes.stacks import AGENT_DIR, AgentReader, agent_env, expand_stacks
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

TARGET = """
import threading, time
def sleeper_here():
    time.sleep(30)
threading.Thread(target=sleeper_here, name="named-sleeper", daemon=True).start()
time.sleep(0.6)
"""


def run_with_agent(tmp_path, code: str, pythonpath: str | None = None) -> list[dict]:
    base = dict(os.environ) | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    base.pop("PYTHONPATH", None) if pythonpath is None else None
    env = agent_env(base, tmp_path, interval=0.02)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    return expand_stacks(AgentReader(tmp_path).read_new())


def test_agent_samples_named_threads_with_native_ids_but_not_itself(tmp_path):
    records = run_with_agent(tmp_path, TARGET)
    hello = records[0]
    samples = [r for r in records if r["kind"] == "stacks"]
    assert hello["kind"] == "agent" and len(samples) >= 5
    threads = {t["name"]: t for t in samples[-1]["threads"]}
    assert set(threads) == {"MainThread", "named-sleeper"}  # the agent's own thread is absent
    assert threads["named-sleeper"]["frames"][-1].startswith("sleeper_here (")
    assert threads["MainThread"]["tid"] == samples[-1]["pid"]
    assert hello["tid"] not in {t["tid"] for t in samples[-1]["threads"]}


def test_agent_chains_to_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "site"
    other.mkdir()
    marker = tmp_path / "chained"
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ok')\n")
    records = run_with_agent(tmp_path, "import time; time.sleep(0.2)", pythonpath=str(other))
    assert marker.read_text() == "ok"
    assert any(r["kind"] == "stacks" for r in records)


def test_agent_is_off_without_its_variable(tmp_path):
    env = agent_env(dict(os.environ), tmp_path, 0.02)
    env.pop("FT_AGENT_OUT")
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_reader_waits_for_a_line_still_being_written(tmp_path):
    path = tmp_path / "stacks-1.jsonl"
    path.write_text(json.dumps({"kind": "stacks", "n": 1}) + "\n" + '{"kind": "sta')
    reader = AgentReader(tmp_path)
    assert [r["n"] for r in reader.read_new()] == [1]
    with open(path, "a") as f:
        f.write('cks", "n": 2}\n')
    assert [r["n"] for r in reader.read_new()] == [2]


def test_a_forked_child_is_sampled_too(tmp_path):
    code = """
import os, time
pid = os.fork()
if pid == 0:
    def forked_child_work():
        time.sleep(0.5)
    forked_child_work()
    os._exit(0)
time.sleep(0.2)
os.waitpid(pid, 0)
"""
    records = run_with_agent(tmp_path, code)
    pids = {r["pid"] for r in records if r["kind"] == "stacks"}
    assert len(pids) == 2
    frames = [
        f for r in records if r["kind"] == "stacks" for t in r["threads"] for f in t["frames"]
    ]
    assert any(f.startswith("forked_child_work (") for f in frames)


SERVICE = """
import threading, time
def sleeper_here():
    time.sleep(60)
threading.Thread(target=sleeper_here, name="named-sleeper", daemon=True).start()
time.sleep(60)
"""


def start_service(folder, code: str = SERVICE) -> subprocess.Popen:
    """A process started with the unit-file variable (and the agent on its PYTHONPATH)."""
    env = dict(os.environ) | {"FT_AGENT_ATTACH": str(folder), "PYTHONPATH": str(AGENT_DIR)}
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def until(condition, timeout: float = 20.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(every)
    raise AssertionError("timed out")


def test_on_demand_agent_writes_only_while_asked(tmp_path):
    proc = start_service(tmp_path)
    try:
        time.sleep(2.5)  # two looks for a request at least
        assert list(tmp_path.iterdir()) == []  # nobody asked: nothing written
        session = AgentSession(tmp_path, interval=0.05, shared=False)
        session.open()
        records: list[dict] = []

        def sampled():
            session.ask([proc.pid])
            records.extend(session.read())
            return sum(r["kind"] == "stacks" for r in records) >= 3

        until(sampled)
        assert session.answered and session.state() == "answered"
        stacks = expand_stacks(records)[-1]["threads"]
        assert any(t["frames"][-1].startswith("sleeper_here (") for t in stacks)
        session.close()
        assert list(tmp_path.iterdir()) == []
        time.sleep(2.5)
        assert list(tmp_path.iterdir()) == []  # it stopped, and does not start again
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_request_nobody_refreshes_stops_the_agent(tmp_path):
    """ft killed mid-run leaves its request behind: the agent stops once it is stale."""
    proc = start_service(tmp_path)
    try:
        (tmp_path / "s1").mkdir()
        request = {"session": "s1", "interval": 0.05, "timeout_s": 1.0}
        (tmp_path / f"request-{proc.pid}.json").write_text(json.dumps(request))
        out = tmp_path / "s1" / f"stacks-{proc.pid}.jsonl"
        until(lambda: out.exists() and out.stat().st_size > 0)
        time.sleep(1.5)
        size = out.stat().st_size
        time.sleep(2.5)
        assert out.stat().st_size == size
    finally:
        proc.kill()
        proc.wait()


def test_ft_serve_and_sitecustomize_together_start_one_agent(tmp_path):
    code = (
        "import threading; from ft.probes.stacks import start_attach_agent; "
        "start_attach_agent(); start_attach_agent(); "
        "print(sum(t.name == 'ft-stack-agent' for t in threading.enumerate()))"
    )
    base = dict(os.environ) | {"PYTHONPATH": os.pathsep.join([str(AGENT_DIR), str(REPO_ROOT)])}
    on = base | {"FT_AGENT_ATTACH": str(tmp_path)}
    for env, agents in ((on, "1"), (base, "0")):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.stdout.strip() == agents, run.stderr


def test_a_thread_that_stays_in_its_frame_is_not_walked_again_but_one_that_moves_is(monkeypatch):
    import threading

    from ft.probes.agent import sitecustomize as agent

    walks = []
    walk = agent._stack_key
    monkeypatch.setattr(agent, "_stack_key", lambda frame: walks.append(1) or walk(frame))

    moved, go_on, done = threading.Event(), threading.Event(), threading.Event()

    def second_place():
        done.wait()

    def first_place():
        go_on.wait()
        moved.set()
        second_place()

    thread = threading.Thread(target=first_place, name="mover")
    thread.start()
    try:
        stack_ids, last, defs = {}, {}, []

        def leaf():
            sample = agent._sample(threading.get_ident(), stack_ids, defs, last)
            (mover,) = [t for t in sample if t["name"] == "mover"]
            frames = {d["id"]: d["frames"] for d in defs}[mover["stack"]]
            names = [f.split(" (")[0].rsplit(".", 1)[-1] for f in frames]
            return next(n for n in reversed(names) if n.endswith("_place"))

        assert leaf() == "first_place"
        walked = len(walks)
        assert leaf() == "first_place" and len(walks) == walked  # nobody moved: no walk
        go_on.set()
        moved.wait()
        until(lambda: leaf() == "second_place")
    finally:
        go_on.set()
        done.set()
        thread.join()


def test_a_thread_whose_frame_cannot_be_walked_misses_one_sample_and_the_agent_goes_on(monkeypatch):
    """CPython 3.11 once gave the agent a code object where a thread's frame was; the agent then
    stopped for the rest of the run and a diagnosis had no stacks. Now only that thread's sample
    is missed, in that tick; the other threads are sampled, and the next tick samples it again."""
    import threading

    from ft.probes.agent import sitecustomize as agent

    current = sys._current_frames
    bad = {"on": True}

    def frames():
        got = current()
        if bad["on"]:
            got[-1] = agent._stack_key.__code__  # a code object, not a frame
        return got

    monkeypatch.setattr(sys, "_current_frames", frames)
    stack_ids, defs, last = {}, [], {}
    sample = agent._sample(-2, stack_ids, defs, last)
    idents = {t["ident"] for t in sample}
    assert threading.get_ident() in idents and -1 not in idents
    bad["on"] = False
    assert threading.get_ident() in {t["ident"] for t in agent._sample(-2, stack_ids, defs, last)}
