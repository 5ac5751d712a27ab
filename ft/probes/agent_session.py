"""ft's side of the on-demand stack agent: ask a running process for stacks, without ptrace.

A process started with FT_AGENT_ATTACH=DIR runs the agent waiting (ft/probes/agent/
sitecustomize.py). A session makes the folder DIR/SESSION, writes DIR/request-PID.json for each
process it wants stacks from and touches the requests every tick; each agent samples into the
session folder while its request stays fresh. Closing removes the requests (the agents stop
within one sample) and the session folder.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from ft.probes.agent.sitecustomize import REQUEST
from ft.probes.stacks import AgentReader
from ft.report import write_text_atomic

# An agent stops once its request is this old: a SIGKILLed ft leaves it sampling this long at most.
# Generous beside the tick, which can wait on py-spy (10 s per process at worst).
REQUEST_TIMEOUT_S = 30.0


class AgentSession:
    """One `ft diagnose --pid` run's conversation with the agents of one FT_AGENT_ATTACH folder."""

    def __init__(self, folder: Path, interval: float, shared: bool):
        self.folder = folder
        self.name = f"ft-diagnose-{os.getpid()}-{secrets.token_hex(4)}"
        self.dir = folder / self.name
        self.interval = interval
        self.shared = shared  # the target runs as another user, who must be able to write here
        self.reader = AgentReader(self.dir)
        self.asked: set[int] = set()
        self.answered = False
        self.error: str | None = None

    def open(self) -> None:
        try:
            if not self.folder.is_dir():
                raise FileNotFoundError(2, "no such folder")
            self.dir.mkdir(mode=0o700)
            if self.shared:
                os.chmod(self.dir, 0o777)  # mkdir's mode passes through the umask
        except OSError as exc:
            self.error = f"cannot use {self.folder}: {exc.strerror or exc}"

    def ask(self, pids: list[int]) -> None:
        """Write a request for each process new to the session; touch the others' (heartbeat)."""
        if self.error is not None:
            return
        for pid in pids:
            path = self.folder / REQUEST.format(pid=pid)
            try:
                if pid in self.asked and path.exists():
                    os.utime(path)
                else:  # new, or removed under us (another run's cleanup): ask again
                    self._write_request(path)
            except OSError as exc:
                self.error = f"cannot write {path}: {exc.strerror or exc}"
                return
            self.asked.add(pid)

    def _write_request(self, path: Path) -> None:
        body = {"session": self.name, "interval": self.interval, "timeout_s": REQUEST_TIMEOUT_S}
        write_text_atomic(path, json.dumps(body) + "\n")
        os.chmod(path, 0o644)  # the agent may run as another user

    def read(self) -> list[dict]:
        """The agents' new records (hello lines and stack samples)."""
        records = self.reader.read_new()
        self.answered = self.answered or any(r.get("kind") == "agent" for r in records)
        return records

    def close(self) -> list[dict]:
        """Read what is left, withdraw the requests, remove the session folder."""
        records = self.read() if self.error is None else []
        for pid in self.asked:
            path = self.folder / REQUEST.format(pid=pid)
            if _session_of(path) == self.name:  # a later run may have taken the request over
                path.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        return records

    def state(self) -> str:
        """For the report: answered, no-answer, not-asked, or why the folder is unusable."""
        if self.error is not None:
            return f"unreachable: {self.error}"
        if self.answered:
            return "answered"
        return "no-answer" if self.asked else "not-asked"


def _session_of(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("session")
    except (OSError, ValueError, AttributeError):
        return None
