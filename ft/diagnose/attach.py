"""`ft diagnose --pid PID`: the probes on a process that is already running (a service).

ft neither starts nor stops it. Stacks come from py-spy --nonblocking where ptrace is permitted
(it reads the target's memory without pausing it) and from the on-demand stack agent where the
process runs one (FT_AGENT_ATTACH, ft/probes/agent_session.py). Detaching withdraws the agent's
requests, and resumes the target if it is stopped now though it was running when ft attached:
a ptrace stop that a killed py-spy left behind is py-spy's known way to hang a service.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path

import psutil

from ft import settings
from ft.diagnose.targets import ProcessTarget
from ft.errors import FtError
from ft.probes.agent_session import AgentSession
from ft.probes.stacks import ptrace_scope
from ft.probes.threads import process_tree

CAP_SYS_PTRACE = 19  # bit in /proc/PID/status CapEff
_PYTHON = re.compile(r"^python[0-9.]*$")
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


class PidTarget(ProcessTarget):
    """A running process ft attached to; its process tree is probed, never signalled to stop."""

    label = "attached"
    may_pause = False  # a live service: py-spy reads it without stopping it

    def __init__(self, pid: int):
        self.process = attachable(pid)
        super().__init__(_cmdline(self.process), Path(os.devnull))  # its output is not ft's
        self._pid = pid
        self.was_stopped = _stopped(self.process)
        self.agent_folder = agent_folder(self.process)
        self.python = _is_python(self.process, self.argv)
        self.session: AgentSession | None = None
        self.agent_wanted = False  # the runner asks for the agent unless --stack-source py-spy
        self.resumed = False
        self._has_agent: dict[int, bool] = {}
        self._final: list[dict] = []
        self._empty_agent_dir: Path | None = None

    @property
    def pid(self) -> int:
        return self._pid

    def start(self, env: dict[str, str]) -> int:
        """Nothing to start; open the agent session where the target runs an agent."""
        wanted = env.get(settings.AGENT_OUT)
        self.agent_wanted = bool(wanted)
        if wanted:
            self._empty_agent_dir = Path(wanted)  # the runner's, for agents ft injects: unused
        if wanted and self.agent_folder:
            interval = float(env.get(settings.AGENT_INTERVAL) or 0.1)
            shared = not _same_user(self.process)
            self.session = AgentSession(Path(self.agent_folder), interval, shared)
            self.session.open()
        return self.pid

    def poll(self) -> int | None:
        return None  # not ft's child: its exit status is for its own parent to read

    def exited(self) -> bool:
        try:  # is_running compares start times: a reused pid is not the target
            return not self.process.is_running() or self.process.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def tick(self) -> list[dict]:
        if self.session is None:
            return []
        self.session.ask([p for p in process_tree(self.pid) if self._runs_agent(p)])
        return self.session.read()

    def _runs_agent(self, pid: int) -> bool:
        if pid not in self._has_agent:
            try:
                folder = agent_folder(psutil.Process(pid))
            except psutil.Error:
                folder = None
            self._has_agent[pid] = folder == self.agent_folder
        return self._has_agent[pid]

    def final_records(self) -> list[dict]:
        return self._final

    def stop(self, grace: float = 3.0) -> None:
        """Detach: withdraw the agent's requests; resume the target only if ft's run stopped it."""
        if self.session is not None:
            self._final = self.session.close()
        if not self.was_stopped and _stopped(self.process):
            try:
                self.process.send_signal(signal.SIGCONT)
                self.resumed = True
            except psutil.Error:
                pass
        if self._empty_agent_dir is not None:
            try:
                self._empty_agent_dir.rmdir()
            except OSError:
                pass

    def context(self) -> dict:
        return {
            "attached": True,
            "pid": self.pid,
            "command": shlex.join(self.argv),
            "python": self.python,
            "agent": self.agent_state(),
            "agent_folder": self.agent_folder,
            "ptrace": ptrace_permission(self.process),
            "resumed": self.resumed,
        }

    def agent_state(self) -> str:
        """not-requested | not-enabled (no FT_AGENT_ATTACH) | answered | no-answer | unreachable."""
        if not self.agent_wanted:
            return "not-requested"
        if not self.agent_folder:
            return "not-enabled"
        return self.session.state() if self.session is not None else "not-asked"

    def describe(self) -> dict:
        return {
            "kind": self.label,
            "pid": self.pid,
            "argv": self.argv,
            "command": shlex.join(self.argv),
            "python": self.python,
        }

    def is_python(self) -> bool:
        return self.python


def attachable(pid: int) -> psutil.Process:
    """The process, if it exists, is alive and its /proc entries can be read; else FtError."""
    if pid == os.getpid():
        raise FtError(f"--pid {pid} is ft itself")
    try:
        proc = psutil.Process(pid)
        status = proc.status()
        os.listdir(f"/proc/{pid}/task")
    except psutil.NoSuchProcess:
        raise FtError(f"--pid {pid}: no such process (or not visible to this user)") from None
    except (psutil.AccessDenied, PermissionError):
        raise FtError(f"--pid {pid}: not permitted to read that process's /proc entries") from None
    except OSError as exc:
        raise FtError(f"--pid {pid}: cannot read /proc/{pid}: {exc.strerror}") from None
    if status == psutil.STATUS_ZOMBIE:
        raise FtError(f"--pid {pid} has exited (a zombie): nothing to attach to")
    return proc


def agent_folder(proc: psutil.Process) -> str | None:
    """FT_AGENT_ATTACH in the process's environment (as it started); None if unset or unreadable."""
    try:
        return proc.environ().get(settings.AGENT_ATTACH) or None
    except psutil.Error:
        return None


def ptrace_permission(proc: psutil.Process) -> dict:
    """What decides whether py-spy may read the process, and the verdict those facts predict.

    py-spy runs as ft's child, never as the target's ancestor, so ptrace_scope=1 denies it
    unless ft has CAP_SYS_PTRACE; 2 needs that capability; 3 denies everyone.
    """
    scope = ptrace_scope()
    cap = has_cap_sys_ptrace()
    same_user = _same_user(proc)
    expected = scope != 3 and (cap or (same_user and scope in (None, 0)))
    return {"scope": scope, "cap_sys_ptrace": cap, "same_user": same_user, "expected": expected}


def has_cap_sys_ptrace(status_path: str = "/proc/self/status") -> bool:
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _same_user(proc: psutil.Process) -> bool:
    try:
        return proc.uids().real == os.getuid()
    except psutil.Error:
        return False


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() in _STOPPED
    except psutil.Error:
        return False


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline() or [proc.name()]  # a kernel thread has no command line
    except psutil.Error:
        return [f"pid {proc.pid}"]


def _is_python(proc: psutil.Process, argv: list[str]) -> bool:
    try:
        exe = Path(proc.exe()).name
    except psutil.Error:
        exe = Path(argv[0]).name if argv else ""
    if _PYTHON.match(exe):
        return True
    try:
        return "libpython" in Path(f"/proc/{proc.pid}/maps").read_text(errors="replace")
    except OSError:
        return False
