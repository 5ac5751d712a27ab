"""`ft diagnose --cmd` on fixture programs, black-box (py-spy's style), with the agent forced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT, ft_env, run_ft

ASSETS = REPO_ROOT / "tests" / "assets"
pytestmark = pytest.mark.timeout(120)


def diagnose(tmp_path: Path, script: str, *extra: str, env=None, exit_code: int = 0) -> dict:
    out = tmp_path / "report"
    cmd = f"{sys.executable} {ASSETS / script}"
    args = ["diagnose", "--cmd", cmd, "--duration", "2", "--interval", "0.2", "--out", str(out)]
    proc = run_ft(*args, *extra, env=env)
    assert proc.returncode == exit_code, proc.stderr
    return json.loads((out / "report.json").read_text())


def finding_ids(report: dict) -> list[str]:
    return [f["id"] for f in report["findings"]]


def thread(report: dict, name: str) -> dict:
    return next(t for t in report["threads"] if t["name"] == name)


def assert_complete(out: Path) -> None:
    for name in ("report.md", "report.json", "stacks.collapsed", "timeline.png", "samples.jsonl"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "report.json").read_text())["schema"] == 1
    assert len((out / "report.md").read_text()) < 65_536


def test_hot_main_thread_beside_idle_pool(tmp_path):
    report = diagnose(tmp_path, "busy_main.py", "--stack-source", "agent")
    assert finding_ids(report)[0] == "hot-thread"
    assert "cpu-pool-idle" in finding_ids(report)
    hot = report["findings"][0]
    main = thread(report, "MainThread")
    assert hot["threads"] == [main["tid"]] and main["role"] == "main"
    assert "spin_inline_experts" in hot["title"]
    assert "spin_inline_experts" in main["top_stack"][-1]
    assert main["top_stack_count"] >= 0.8 * main["stack_samples"] > 0
    assert {thread(report, f"ft-cpu-moe-{k}")["role"] for k in range(3)} == {"cpu-moe pool"}
    assert "spin_inline_experts" in (tmp_path / "report" / "stacks.collapsed").read_text()
    assert_complete(tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert md.index("hot-thread") < md.index("## Threads")


def test_everything_idle_has_no_findings(tmp_path):
    report = diagnose(tmp_path, "all_idle.py", "--stack-source", "agent")
    assert finding_ids(report) == []
    assert all(t["cpu_pct"] < 50 for t in report["threads"])
    assert "idle_worker" in thread(report, "idle-0")["top_stack"][-1]


def test_lock_waiter_is_blocked_not_hot(tmp_path):
    report = diagnose(tmp_path, "lock_wait.py", "--stack-source", "agent")
    assert "hot-thread" not in finding_ids(report)
    waiter = thread(report, "lock-waiter")
    assert waiter["r_frac"] < 0.5 and waiter["cpu_pct"] < 20
    assert "wait_for_the_lock" in waiter["top_stack"][-1]
    assert "hold_the_lock" in thread(report, "MainThread")["top_stack"][-1]


def test_target_killed_midway_still_leaves_a_complete_report(tmp_path):
    report = diagnose(tmp_path, "dies_midway.py", "--stack-source", "agent", exit_code=137)
    assert report["run"]["stopped_by"] == "target-exit"
    assert report["run"]["failure"] == "the command exited with signal 9"
    assert report["run"]["exit_code"] == -signal.SIGKILL
    assert report["run"]["stack_samples"] > 0
    assert "spin_until_killed" in thread(report, "MainThread")["top_stack"][-1]
    assert_complete(tmp_path / "report")


def test_ptrace_denied_falls_back_to_the_agent(tmp_path):
    path = f"{ASSETS / 'fake_pyspy'}{os.pathsep}{os.environ['PATH']}"
    report = diagnose(tmp_path, "busy_main.py", "--stack-source", "auto", env=ft_env(PATH=path))
    denied = next(f for f in report["findings"] if f["id"] == "ptrace-denied")
    assert "in-process stack agent" in denied["title"]
    assert "Permission Denied" in denied["evidence"]["py_spy_error"]
    assert finding_ids(report)[0] == "hot-thread"


def test_py_spy_alone_where_ptrace_is_permitted(tmp_path):
    report = diagnose(tmp_path, "busy_main.py", "--stack-source", "py-spy")
    if "ptrace-denied" in finding_ids(report):
        pytest.skip("ptrace is not permitted here")
    assert report["run"]["stack_source"] == "py-spy"
    assert not (tmp_path / "report" / "agent").exists()  # no agent injected
    main = thread(report, "MainThread")
    assert "spin_inline_experts" in main["top_stack"][-1]  # never a libc or vdso leaf
    assert any("spin_inline_experts" in frame for frame in main["native_stack"])
    assert finding_ids(report)[0] == "hot-thread"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_writes_the_report_and_stops_a_stopped_target(tmp_path, sig):
    out = tmp_path / "report"
    ft, target = _sampling_busy_main(out)
    target.suspend()  # SIGSTOP: ft must resume it before stopping it
    time.sleep(0.5)
    ft.send_signal(sig)
    _, err = ft.communicate(timeout=60)
    assert ft.returncode == 128 + sig, err
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["stopped_by"] == sig.name
    assert_complete(out)
    assert not target.is_running() or target.status() == psutil.STATUS_ZOMBIE


def test_a_burst_of_signals_stops_ft_once_with_the_report_written(tmp_path):
    # Python runs a signal's handler between two bytecodes of the main thread, possibly inside
    # the handler of the signal before: a handler that took a lock (threading.Event.set) hung
    # ft there. A burst lands handlers inside handlers.
    out = tmp_path / "report"
    ft, _ = _sampling_busy_main(out)
    for _ in range(20000):
        ft.send_signal(signal.SIGHUP)
    try:
        _, err = ft.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        ft.kill()
        raise AssertionError("ft hung after a burst of SIGHUP") from None
    assert ft.returncode == 128 + signal.SIGHUP, err
    assert json.loads((out / "report.json").read_text())["run"]["stopped_by"] == "SIGHUP"
    assert_complete(out)


def _sampling_busy_main(out: Path) -> tuple[subprocess.Popen, psutil.Process]:
    """`ft diagnose` on busy_main.py for up to 60 s, once its first stacks are on disk."""
    cmd = f"{sys.executable} {ASSETS / 'busy_main.py'}"
    args = ["diagnose", "--cmd", cmd, "--duration", "60", "--interval", "0.25", "--out", str(out)]
    ft = subprocess.Popen([sys.executable, "-m", "ft", *args], env=ft_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    target = _wait_for_target(ft.pid)
    _wait_for(lambda: '"kind":"stacks"' in (out / "samples.jsonl").read_text())
    return ft, target


def _wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _wait_for_target(ft_pid: int, threads: int = 4) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(ft_pid).children()
        if children and children[0].num_threads() >= threads:  # its threads have started
            return children[0]
        time.sleep(0.1)
    raise AssertionError("the target never started")


def test_sigkill_to_ft_takes_the_target_with_it(tmp_path):
    cmd = f"{sys.executable} {ASSETS / 'all_idle.py'}"
    args = ["diagnose", "--cmd", cmd, "--duration", "60", "--out", str(tmp_path / "r")]
    ft = subprocess.Popen([sys.executable, "-m", "ft", *args], env=ft_env())
    target = _wait_for_target(ft.pid, threads=3)
    ft.kill()
    ft.wait(timeout=30)
    target.wait(timeout=30)  # raises if it outlives ft (an orphan)


def test_non_python_target_reports_without_stacks(tmp_path):
    out = tmp_path / "report"
    proc = run_ft("diagnose", "--cmd", "sleep 10", "--duration", "2", "--interval", "0.5",
                  "--out", str(out), "--stack-source", "agent")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["stack_source"] is None and report["threads"][0]["comm"] == "sleep"
    assert "No stack samples" in (out / "report.md").read_text()


def test_a_command_that_fails_keeps_its_report_and_returns_its_exit_code(tmp_path):
    out = tmp_path / "report"
    cmd = "sh -c 'echo starting; echo oops: no such input >&2; exit 3'"
    proc = run_ft("diagnose", "--cmd", cmd, "--duration", "5", "--out", str(out))
    assert proc.returncode == 3
    assert proc.stderr == "error: the command exited with code 3: oops: no such input\n"
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["exit_code"] == 3 and "code 3" in report["run"]["failure"]
    assert (
        "**The target failed**: the command exited with code 3" in (out / "report.md").read_text()
    )
    proc = run_ft("diagnose", "--cmd", "true", "--duration", "5", "--out", str(tmp_path / "ok"))
    assert proc.returncode == 0 and proc.stderr == ""  # a command that finishes is no failure


def test_engine_mode_with_a_server_that_cannot_start_is_one_error(tmp_path):
    out = tmp_path / "report"
    args = ["--strategy", "offload", "--model", str(tmp_path / "no-such-model"), "--out", str(out)]
    proc = run_ft("diagnose", *args, "--duration", "60")
    assert proc.returncode == 1
    assert proc.stdout == ""  # no "stopped by", no findings
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: `ft serve --moe-strategy offload`")
    assert (
        f"before it was ready: model directory not found: {tmp_path / 'no-such-model'}" in lines[0]
    )
    report = json.loads((out / "report.json").read_text())
    assert report["findings"] == [] and report["run"]["failure"] in lines[0]
    assert "No diagnosis: the server failed before it was ready" in (out / "report.md").read_text()
    proc = run_ft(
        "diagnose", "--strategy", "offload", "--vs", "bogus", "--out", str(tmp_path / "v")
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: unknown strategy 'bogus'")
    assert not (tmp_path / "v").exists()  # refused before the first run


def test_bad_input_is_one_line_error(tmp_path):
    proc = run_ft("diagnose", "--cmd", "x", "--stack-source", "gdb", "--out", str(tmp_path))
    assert proc.returncode == 1 and proc.stderr.startswith("error: --stack-source")
    proc = run_ft(
        "diagnose", "--cmd", "/nonexistent/prog", "--duration", "1", "--out", str(tmp_path)
    )
    assert proc.returncode == 1 and "error: cannot start" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_folder_is_never_reused(tmp_path):
    (tmp_path / "samples.jsonl").write_text("earlier run\n")
    proc = run_ft("diagnose", "--cmd", "true", "--out", str(tmp_path))
    assert proc.returncode == 1 and "already holds a diagnose run" in proc.stderr
    assert (tmp_path / "samples.jsonl").read_text() == "earlier run\n"
