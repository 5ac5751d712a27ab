"""Start `ft serve` as a child process, wait for its ready line, stop it cleanly.

Shared by `ft bench serve`, diagnose and bisect (which passes the `python` of the commit's
environment). The child's stdout and stderr go to a log file, never a pipe that could fill
and stall the server; the ready line is read from that file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ft.errors import FtError

READY_RE = re.compile(r"API server is ready to serve on (\S+):(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        return _tail(self.log_path, lines)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the server shuts down cleanly), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    serve_args: list[str] | tuple[str, ...] = (),
    *,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    timeout_s: float = 600.0,
    cwd: str | Path | None = None,
) -> ServerProcess:
    """Run `command + serve_args` (default `python -m ft serve --port 0 ...`) until it is ready."""
    command = command or [sys.executable, "-m", "ft", "serve"]
    args = list(serve_args)
    if "--port" not in args:
        args += ["--port", "0"]  # a free port, read back from the ready line
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="ft-serve-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    host, port = _wait_ready(proc, log_path, timeout_s)
    return ServerProcess(proc, host, port, log_path)


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = READY_RE.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1), int(match.group(2))
        if proc.poll() is not None:
            raise FtError(
                f"ft serve exited with status {proc.returncode} before it was ready; "
                f"its log ({log_path}) ends with:\n{_tail(log_path, 20)}"
            )
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise FtError(f"ft serve was not ready after {timeout_s:.0f} s; its log is {log_path}")


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
