"""`ft diagnose --pid` on processes started outside ft: a fixture service and a real `ft serve`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from ft.probes.stacks import AGENT_DIR
from tests.conftest import REPO_ROOT, ft_env, run_ft

ASSETS = REPO_ROOT / "tests" / "assets"
FAKE_PYSPY = f"{ASSETS / 'fake_pyspy'}{os.pathsep}{os.environ['PATH']}"  # ptrace denied
pytestmark = pytest.mark.timeout(180)


@contextmanager
def service(tmp_path: Path, agent_folder: Path | None = None):
    """The fixture service, started as a service manager would: not by ft, in its own session."""
    beat = tmp_path / "heartbeat"
    env = dict(os.environ)
    if agent_folder is not None:
        env |= {"FT_AGENT_ATTACH": str(agent_folder), "PYTHONPATH": str(AGENT_DIR)}
    proc = subprocess.Popen(
        [sys.executable, str(ASSETS / "spin_service.py"), str(beat)],
        env=env,
        start_new_session=True,
    )
    try:
        wait_for(lambda: beat.exists() and psutil.Process(proc.pid).num_threads() >= 5)
        yield proc, beat
    finally:
        proc.kill()
        proc.wait(timeout=30)


def attach(pid: int, out: Path, *extra: str, env=None) -> dict:
    args = ["diagnose", "--pid", str(pid), "--duration", "3", "--interval", "0.25", "--out"]
    proc = run_ft(*args, str(out), *extra, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "report.json").read_text())


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def finding(report: dict, fid: str) -> dict:
    return next(f for f in report["findings"] if f["id"] == fid)


def snapshot(pid: int) -> tuple:
    p = psutil.Process(pid)
    return p.create_time(), p.num_threads(), p.cmdline()


def assert_runs_on_unchanged(proc: subprocess.Popen, beat: Path, before: tuple) -> None:
    """Same process, same threads, not stopped, still making progress."""
    p = psutil.Process(proc.pid)
    assert proc.poll() is None and snapshot(proc.pid) == before
    assert p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    first = int(beat.read_text() or 0)
    wait_for(lambda: int(beat.read_text() or 0) > first + 3, timeout=10)


def test_attach_names_the_hot_thread_and_its_function(tmp_path):
    with service(tmp_path) as (proc, beat):
        before = snapshot(proc.pid)
        report = attach(proc.pid, tmp_path / "report")
        if "stacks-unavailable" in [f["id"] for f in report["findings"]]:
            pytest.skip("ptrace is not permitted here")
        assert_runs_on_unchanged(proc, beat, before)
    hot = report["findings"][0]
    assert hot["id"] == "hot-thread" and hot["severity"] == "critical"
    assert "thread ft-engine" in hot["title"] and "spin_inline_experts" in hot["title"]
    assert report["run"]["stack_source"] == "py-spy"
    assert report["target"]["kind"] == "attached" and report["target"]["pid"] == proc.pid
    roles = {t["name"]: t["role"] for t in report["threads"]}
    assert {roles[f"ft-cpu-moe-{k}"] for k in range(3)} == {"cpu-moe pool"}
    assert f"attached to pid {proc.pid}" in (tmp_path / "report" / "report.md").read_text()
    assert not (tmp_path / "report" / "agent").exists()


@pytest.mark.parametrize(
    "path, why, how",
    [
        (FAKE_PYSPY, "ptrace is not permitted", "CAP_SYS_PTRACE"),
        ("/nonexistent", "py-spy is not installed", "pip install py-spy"),
    ],
    ids=["ptrace-denied", "no-py-spy"],
)
def test_attach_without_stacks_says_why_and_how(tmp_path, path, why, how):
    with service(tmp_path) as (proc, _):
        report = attach(proc.pid, tmp_path / "report", env=ft_env(PATH=path))
    hot = report["findings"][0]
    assert hot["id"] == "hot-thread" and "thread ft-engine" in hot["title"]
    assert hot["threads"] == [next(t["tid"] for t in report["threads"] if t["name"] == "ft-engine")]
    ids = [f["id"] for f in report["findings"]]
    assert ids.count("stacks-unavailable") == 1 and "ptrace-denied" not in ids  # one finding
    stacks = finding(report, "stacks-unavailable")
    assert why in stacks["title"] and "FT_AGENT_ATTACH" in stacks["title"]
    assert how in stacks["next_step"]
    assert 'ft diagnose --cmd "' in stacks["next_step"] and "spin_service.py" in stacks["next_step"]
    assert "Environment=FT_AGENT_ATTACH=" in stacks["next_step"]


def test_ctrl_c_leaves_the_target_running_and_the_agent_quiet(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    out = tmp_path / "report"
    with service(tmp_path, agent_folder=folder) as (proc, beat):
        before = snapshot(proc.pid)
        args = ["diagnose", "--pid", str(proc.pid), "--duration", "60", "--out", str(out)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        ft = subprocess.Popen([sys.executable, "-m", "ft", *args], env=ft_env(), **pipes)
        wait_for(lambda: '"source":"agent"' in _text(out / "samples.jsonl"))
        pyspy = ('"source":"py-spy"', '"ptrace-denied"')  # py-spy read it, or may not here
        wait_for(lambda: any(mark in _text(out / "samples.jsonl") for mark in pyspy))
        ft.send_signal(signal.SIGINT)
        _, err = ft.communicate(timeout=60)
        assert ft.returncode == 128 + signal.SIGINT, err
        assert json.loads((out / "report.json").read_text())["run"]["stopped_by"] == "SIGINT"
        assert_runs_on_unchanged(proc, beat, before)
        assert list(folder.iterdir()) == []  # requests withdrawn, session folder removed
        time.sleep(2.5)  # the agent looks once a second: it must not start again on its own
        assert list(folder.iterdir()) == []


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_an_engine_started_with_the_agent_variable_gives_stacks_without_ptrace(
    tmp_path_factory, tmp_path
):
    from ft.bench.server_process import start_server

    folder = tmp_path / "agent"
    folder.mkdir()
    cache = tmp_path_factory.getbasetemp() / "ft-cache"  # the conftest's: one tiny model per run
    env = ft_env(FT_CACHE_DIR=str(cache), FT_AGENT_ATTACH=str(folder))
    with start_server([], env=env, log_path=tmp_path / "serve.log", timeout_s=180) as server:
        report = attach(server.proc.pid, tmp_path / "report", env=ft_env(PATH=FAKE_PYSPY))
        assert server.proc.poll() is None
        import httpx

        assert httpx.get(f"{server.url}/health", timeout=30, trust_env=False).status_code == 200
    assert report["run"]["stack_source"] == "agent" and report["run"]["stack_samples"] > 5
    assert report["context"]["agent"] == "answered"
    denied = finding(report, "ptrace-denied")
    assert "in-process stack agent" in denied["title"]
    assert "stacks-unavailable" not in [f["id"] for f in report["findings"]]
    frames = [f for t in report["threads"] for f in t["top_stack"]]
    assert any("worker.py" in f and "EngineWorker" in f for f in frames), frames
    assert list(folder.iterdir()) == []


def test_bad_pids_are_one_line_errors(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: psutil.Process(gone.pid).status() == psutil.STATUS_ZOMBIE)
    try:
        cases = {
            "999999999": "no such process",
            str(gone.pid): "has exited (a zombie)",
            "0": "--pid",
        }
        for pid, message in cases.items():
            proc = run_ft("diagnose", "--pid", pid, "--out", str(tmp_path / "r"))
            assert proc.returncode == 1 and proc.stderr.startswith("error: "), proc.stderr
            assert message in proc.stderr and len(proc.stderr.splitlines()) == 1
    finally:
        gone.wait()
    proc = run_ft("diagnose", "--pid", "1", "--cmd", "true", "--out", str(tmp_path / "r"))
    assert proc.returncode == 1 and "give one of" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("stopped_before", [False, True], ids=["stopped-mid-run", "found-stopped"])
def test_detach_resumes_only_a_target_that_was_running_when_ft_attached(tmp_path, stopped_before):
    """A stop during the run (as a killed py-spy leaves one) is undone; a user's own is not."""
    from ft.diagnose.attach import PidTarget
    from ft.diagnose.runner import DiagnoseConfig, diagnose

    with service(tmp_path) as (proc, _):
        target_proc = psutil.Process(proc.pid)
        if stopped_before:
            target_proc.suspend()
            wait_for(lambda: target_proc.status() == psutil.STATUS_STOPPED)
        target = PidTarget(proc.pid)
        timer = threading.Timer(0.5, target_proc.suspend)
        timer.start()
        config = DiagnoseConfig(tmp_path / "report", duration=1.5, interval=0.25,
                                stack_source="agent")  # fmt: skip
        outcome, _ = diagnose(target, config)
        timer.join()
        assert outcome.stopped_by == "duration" and proc.poll() is None
        stopped = target_proc.status() == psutil.STATUS_STOPPED
        assert stopped == stopped_before and target.resumed != stopped_before
        target_proc.resume()


def test_py_spy_reads_an_attached_target_without_pausing_it(tmp_path, monkeypatch):
    from ft.diagnose.attach import PidTarget
    from ft.diagnose.runner import DiagnoseConfig, diagnose
    from ft.probes import stacks

    calls: list[list[str]] = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Error: Permission Denied")

    monkeypatch.setattr(stacks.shutil, "which", lambda name: "/usr/bin/py-spy")
    monkeypatch.setattr(stacks.subprocess, "run", fake_run)
    with service(tmp_path) as (proc, _):
        config = DiagnoseConfig(tmp_path / "report", duration=1.5, interval=0.25)
        diagnose(PidTarget(proc.pid), config)
    assert calls and all("--nonblocking" in c and "--native" not in c for c in calls)
