"""The judge of a commit is swappable: anything with `config()` and `measure()`.

`measure(worktree, env)` returns one sample (a float) or a Skip with the reason; the driver
calls it again for more samples and calls `release(worktree)` when it moves to another commit,
so a judge may keep something running between samples (engine mode keeps the server up). Such a
judge says so (`keeps_state`): the driver then alternates commits in blocks, not sample by
sample, since every switch costs a restart.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Protocol

from ft.bisect.verdict import Skip, command_outcome


class Judge(Protocol):
    keeps_state: bool  # something stays up between samples of one commit

    def config(self) -> dict[str, Any]:
        """What is measured and how: hashed into the sample key, shown in the report."""
        ...

    def measure(self, worktree: Path, env: dict[str, str]) -> float | Skip: ...

    def describe(self, worktree: Path) -> dict[str, Any]:
        """Facts about this checkout worth keeping beside its samples (e.g. startup lines)."""
        ...

    def release(self, worktree: Path) -> None: ...


class RunCommandJudge:
    """`--run CMD`: a shell command in the commit's worktree prints the figure (git bisect run
    exit codes: 125 = skip; any other failure is a skip too, with its reason)."""

    keeps_state = False  # every sample is a fresh process: commits may alternate freely

    def __init__(self, command: str, metric: str | None = None, timeout_s: float = 600.0):
        self.command, self.metric, self.timeout_s = command, metric, timeout_s

    def config(self) -> dict[str, Any]:
        return {"judge": "run", "command": self.command, "metric": self.metric}

    def measure(self, worktree: Path, env: dict[str, str]) -> float | Skip:
        result = run_group(self.command, worktree, env, self.timeout_s)
        if isinstance(result, Skip):
            return result
        returncode, out, err = result
        failed = command_outcome(returncode)
        if failed:
            return Skip(_with_tail(failed.reason, err or out))
        return parse_figure(out, self.metric)

    def describe(self, worktree: Path) -> dict[str, Any]:
        return {}

    def release(self, worktree: Path) -> None:
        pass


def run_group(
    command: str | list[str], cwd: Path, env: dict[str, str], timeout_s: float
) -> tuple[int, str, str] | Skip:
    """Run in its own process group, so a timeout or Ctrl-C ends its children too."""
    proc = subprocess.Popen(
        command,
        shell=isinstance(command, str),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _ACTIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return Skip(f"the command timed out after {timeout_s:g} s")
    except BaseException:  # Ctrl-C: leave nothing running behind us
        kill_group(proc)
        raise
    finally:
        _ACTIVE.discard(proc)
    return proc.returncode, out, err


_ACTIVE: set[subprocess.Popen] = set()  # children of any worker thread, for Ctrl-C


def kill_active() -> None:
    """Ctrl-C: end every command still running in a worker thread (their samples are lost)."""
    for proc in list(_ACTIVE):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def parse_figure(stdout: str, metric: str | None) -> float | Skip:
    """The number on the last line, or the --metric key (dotted path) of a JSON object."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return Skip("the command printed nothing")
    last = lines[-1]
    value: Any = last
    if metric:
        value = _json_metric(last, metric)
        if value is None:
            value = _json_metric(stdout, metric)
        if value is None:
            return Skip(f"no {metric!r} in a JSON object on the last line: {last[:80]!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        return Skip(f"the last line is not a number: {str(value)[:80]!r}")
    return number if math.isfinite(number) else Skip(f"the figure is {number}")


def _json_metric(text: str, metric: str) -> Any:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    for part in metric.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _with_tail(reason: str, output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return f"{reason}: {lines[-1][:160]}" if lines else reason
