"""What `ft diagnose` runs: a target starts processes, may feed records, and is stopped cleanly.

CommandTarget (`--cmd`) here; PidTarget (ft/diagnose/attach.py, `--pid`) attaches to a running
process instead of starting one; ServerTarget (ft/diagnose/server_target.py, engine mode) starts
`ft serve`, waits for "ready to serve", runs the workload in a thread; tick() returns phase and
throughput records, finished() ends the run with the workload, context() names the strategy.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil

from ft.errors import FtError

_SHELL = re.compile(r"[|&;<>()$`*?~\n]")  # anything only a shell can run
_PYTHON = re.compile(r"^python[0-9.]*$")


class ProcessTarget:
    """A process group started by ft; its output goes to a log file beside the report."""

    label = "process"
    may_pause = True  # ft owns it: py-spy may pause it to unwind native frames

    def __init__(self, argv: list[str], log_path: Path):
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, env: dict[str, str]) -> int:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(  # own session: a Ctrl-C goes to ft, which stops it
                    self.argv,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise FtError(f"cannot start {shlex.join(self.argv)}: {exc.strerror}") from exc
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def exited(self) -> bool:
        """The target is gone (a process ft did not start has no exit status for ft to read)."""
        return self.poll() is not None

    def tick(self) -> list[dict]:
        """Records the target adds to the stream each interval (throughput for the server)."""
        return []

    def final_records(self) -> list[dict]:
        """Records written once the target is stopped (the workload's figures for the server)."""
        return []

    def finished(self) -> bool:
        """The target's own work is done (a workload completed); a plain command never is."""
        return False

    def context(self) -> dict:
        """Facts for the findings rules (strategy, whether CPU expert work is expected), from the
        engine's startup lines when the target is an `ft serve`."""
        from ft.diagnose.startup import parse

        try:
            return parse(self.log_path.read_text(errors="replace"))
        except OSError:
            return {}

    def describe(self) -> dict:
        return {"kind": self.label, "argv": self.argv, "python": self.is_python()}

    def failure(self, exit_code: int | None) -> str | None:
        """Why the run failed, in one line, once the target exited on its own with exit_code
        (None: it did not exit); None when it did not fail (a command that exits 0 is done)."""
        if not exit_code:
            return None
        return (
            f"the {self.label} exited with {exit_text(exit_code)}{last_error_line(self.log_path)}"
        )

    def is_python(self) -> bool:
        exe = Path(self.argv[0]).name if self.argv else ""
        return bool(_PYTHON.match(exe)) or (self.argv[:2] == ["uv", "run"])

    def stop(self, grace: float = 3.0) -> None:
        """Resume (never leave it SIGSTOPped), then SIGTERM the group, then SIGKILL what is left."""
        if self.proc is None:
            return
        tree = _tree(self.proc.pid)
        _signal_all(self.proc.pid, tree, signal.SIGCONT)
        _signal_all(self.proc.pid, tree, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or _alive(tree)):
            time.sleep(0.05)
        _signal_all(self.proc.pid, _alive(tree), signal.SIGKILL)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # unkillable (D state): leave it, but say so
            pass


def exit_text(exit_code: int) -> str:
    return f"code {exit_code}" if exit_code >= 0 else f"signal {-exit_code}"


def last_error_line(log_path: Path) -> str:
    """`: ` and the target's own last error line (else its last line), or "" if it said nothing:
    the line that says why it failed, which otherwise sits in target.log."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    line = (errors or lines or [""])[-1].removeprefix("error: ")
    return f": {line[:300]}" if line else ""


_ERROR_LINE = re.compile(r"(error\b|[\w.]*(Error|Exception|Exit)\b)", re.IGNORECASE)


def _die_with_parent() -> None:
    """In the child before exec: if ft itself is SIGKILLed, the kernel kills the target too."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux only; elsewhere a no-op)
    except (OSError, AttributeError):
        pass


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _signal_all(pgid: int, procs: list[psutil.Process], sig: int) -> None:
    """The process group first, then each known descendant (some may have left the group)."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


class CommandTarget(ProcessTarget):
    """`ft diagnose --cmd "COMMAND"`: any program; through /bin/sh only when it needs a shell."""

    label = "command"

    def __init__(self, command: str, log_path: Path):
        if not command.strip():
            raise FtError("--cmd is empty")
        try:
            argv = ["/bin/sh", "-c", command] if _SHELL.search(command) else shlex.split(command)
        except ValueError as exc:
            raise FtError(f"cannot parse --cmd: {exc}") from exc
        super().__init__(argv, log_path)
        self.command = command

    def describe(self) -> dict:
        return super().describe() | {"command": self.command}
