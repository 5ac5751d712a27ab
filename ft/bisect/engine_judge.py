"""Engine mode: each commit's own `ft serve`, measured through the API by today's client.

The server API is the stable interface between today's driver and yesterday's engine. Per
commit: a Python environment that has its dependencies (reused while pyproject.toml's
dependencies do not change; the commit itself runs from its worktree via PYTHONPATH, so a step
costs seconds plus the measurement), `ft serve` with the model and engine flags, a warm-up
workload that is dropped, then one workload per sample; the server stops on release.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from ft.bisect.envs import EnvCache
from ft.bisect.judge import kill_group, run_group
from ft.bisect.verdict import Skip

READY = re.compile(r"API server is ready to serve on (\S+):(\d+)")  # docs/engine.md, startup lines
STARTUP = (  # the startup lines that say how the engine resolved itself (docs/engine.md)
    "Resolved config:",
    "MoE experts:",
    "--moe-cache-auto resolved",
    "--moe-hybrid-max-fetch",
    "torch intra-op threads:",
    "CPU MoE executor ready:",
    "Allocating",
)
PORT_TAKEN = "Address already in use"
PORT_TRIES = 3
Workload = Callable[[str, Any, dict[str, str]], "float | Skip"]


@dataclass
class Server:
    proc: Any  # subprocess.Popen
    base_url: str
    log: Path

    def startup_lines(self) -> list[str]:
        """The resolved-config lines, without the log prefix: compared across commits."""
        text = self.log.read_text(errors="replace")
        return [ln[ln.index(key) :] for ln in text.splitlines() for key in STARTUP if key in ln]


class EngineJudge:
    keeps_state = True  # the server stays up between samples of one commit

    def __init__(self, opts: Any, cache: Path, workload: Workload | None = None):
        self.opts = opts  # driver.EngineOptions
        self.envs = EnvCache(cache, opts.install_timeout_s)
        self.workload = workload or client_workload
        self._servers: dict[Path, Server] = {}
        self._flags_ok: set[str] = set()  # commits whose `ft serve --help` had every flag

    def config(self) -> dict[str, Any]:
        keep = ("model", "serve_args", "prompts", "max_tokens", "concurrency", "figure")
        return {"judge": "engine", **{k: v for k, v in asdict(self.opts).items() if k in keep}}

    def measure(self, worktree: Path, env: dict[str, str]) -> float | Skip:
        server = self._servers.get(worktree)
        if server is None:
            started = self._start(worktree, env)
            if isinstance(started, Skip):
                return started
            server = self._servers[worktree] = started
            warm = self.workload(server.base_url, self.opts, env)  # warm-up, dropped
            if isinstance(warm, Skip):
                return self._fail(worktree, warm)
        value = self.workload(server.base_url, self.opts, env)
        return self._fail(worktree, value) if isinstance(value, Skip) else value

    def describe(self, worktree: Path) -> dict[str, Any]:
        """What the driver records beside the samples: the server's startup lines."""
        server = self._servers.get(worktree)
        return {"startup": server.startup_lines()} if server else {}

    def release(self, worktree: Path) -> None:
        server = self._servers.pop(worktree, None)
        if server is not None:
            kill_group(server.proc)

    def _fail(self, worktree: Path, skip: Skip) -> Skip:
        server = self._servers.get(worktree)
        tail = _tail(server.log) if server else ""
        self.release(worktree)
        return Skip(f"{skip.reason}{f'; server log: {tail}' if tail else ''}")

    def serve_command(self, python: Path, port: int) -> list[str]:
        model = ["--model", self.opts.model] if self.opts.model else []
        flags = shlex.split(self.opts.serve_args)
        return [str(python), "-m", "ft", "serve", *model, *flags, "--host", "127.0.0.1",
                "--port", str(port)]  # fmt: skip

    def _start(self, worktree: Path, env: dict[str, str]) -> Server | Skip:
        python = self.envs.python_for(worktree)
        if isinstance(python, Skip):
            return python
        env = commit_env(worktree, env)
        command = self.serve_command(python, _free_port())
        commit = env.get("FT_BISECT_COMMIT")  # the stack is fixed for a run: commit = checkout
        if not commit or commit not in self._flags_ok:
            missing = self._missing_flags(command, worktree, env)
            if isinstance(missing, Skip):
                return missing
            self._flags_ok.add(commit or "")
        log = worktree.parent / f"{worktree.name}.serve.log"
        for _ in range(PORT_TRIES):
            started = _launch(command, worktree, env, log, self.opts.start_timeout_s)
            if not (isinstance(started, Skip) and PORT_TAKEN in started.reason):
                return started
            # Between our probe closing the port and the server binding it, another worker's
            # client (or any process) may take it as an ephemeral port: a new port, not a skip.
            command = self.serve_command(python, _free_port())
        return started

    def _missing_flags(self, command: list[str], worktree: Path, env: dict) -> Skip | None:
        """A commit whose `ft serve` lacks a flag we pass is skipped, not mis-measured."""
        result = run_group([*command[:4], "--help"], worktree, env, 120)
        if isinstance(result, Skip):
            return Skip(f"`ft serve --help` {result.reason.removeprefix('the command ')}")
        rc, out, err = result
        if rc != 0:
            return Skip(f"this commit has no working `ft serve` (exit {rc}): {_last(err or out)}")
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", out))
        wanted = [a.split("=")[0] for a in command[4:] if a.startswith("--")]
        if lacking := [f for f in wanted if f not in known]:
            return Skip(f"`ft serve` at this commit lacks {', '.join(lacking)}")
        return None


def _launch(command: list[str], cwd: Path, env: dict, log: Path, timeout_s: float) -> Any:
    import subprocess

    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if m := READY.search(log.read_text(errors="replace")):
                return Server(proc, f"http://{m.group(1)}:{m.group(2)}", log)
            if proc.poll() is not None:
                return Skip(f"`ft serve` exited ({proc.returncode}) before it was ready: "
                            f"{_tail(log)}")  # fmt: skip
            time.sleep(0.1)
    except BaseException:  # Ctrl-C while it boots: nobody holds it yet to stop it later
        kill_group(proc)
        raise
    kill_group(proc)
    return Skip(f"`ft serve` was not ready after {timeout_s:g} s: {_tail(log)}")


def client_workload(base_url: str, opts: Any, env: dict[str, str]) -> float | Skip:
    """Today's workload client (ft/bench/workload.py) against that commit's server; every
    request carries the workload timeout, so a hung server becomes a skip, not a hang."""
    from ft.bench.workload import run_workload
    from ft.errors import FtError

    try:
        res = run_workload(
            base_url, prompts=opts.prompts, max_tokens=opts.max_tokens,
            concurrency=opts.concurrency, seed=0, timeout_s=opts.workload_timeout_s,
        )  # fmt: skip
    except (FtError, OSError, httpx.HTTPError) as exc:
        return Skip(f"workload failed: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}")
    if res.errors:
        return Skip(f"workload: {res.errors} of {opts.prompts} requests failed")
    value = getattr(res, opts.figure, None)
    if value is None:
        return Skip(f"the workload gave no {opts.figure}")
    return float(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _tail(log: Path) -> str:
    return _last(log.read_text(errors="replace")) if log.exists() else ""


def commit_env(worktree: Path, env: dict[str, str]) -> dict[str, str]:
    """The commit's source first on the path; what the path held before stays behind it (the
    commit's dependencies may live there, as they did when the driver checked them)."""
    path = os.pathsep.join(p for p in (str(worktree), env.get("PYTHONPATH", "")) if p)
    return dict(env, PYTHONPATH=path, COLUMNS="200", NO_COLOR="1", TERM="dumb")
