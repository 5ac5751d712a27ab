"""Python stacks of a target: the in-process agent (no ptrace) and py-spy (where ptrace works)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ft import settings

AGENT_DIR = Path(__file__).resolve().parent / "agent"
STACK_SOURCES = ("auto", "agent", "py-spy")
_DENIED = ("permission denied", "operation not permitted", "ptrace", "eperm")


def agent_env(base: dict[str, str], out_dir: Path, interval: float) -> dict[str, str]:
    """The target's environment with the agent injected: our sitecustomize first on PYTHONPATH."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AGENT_DIR), base.get("PYTHONPATH")) if p)
    env[settings.AGENT_OUT] = str(out_dir)
    env[settings.AGENT_INTERVAL] = str(interval)
    return env


class AgentReader:
    """Tails the agent's stacks-PID.jsonl files; returns only complete new lines."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[dict]:
        records = []
        for path in sorted(self.folder.glob("stacks-*.jsonl")):
            records += self._read_file(path)
        return records

    def _read_file(self, path: Path) -> list[dict]:
        start = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offsets[path] = start + end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def expand_stacks(records: list[dict]) -> list[dict]:
    """Give every agent thread sample its frames, from the stack ids the agent defined earlier."""
    defined: dict[int, dict[int, list[str]]] = {}
    for rec in records:
        if rec.get("kind") != "stacks" or rec.get("source") != "agent":
            continue
        table = defined.setdefault(rec["pid"], {})
        if rec.get("reset"):
            table.clear()
        table.update((d["id"], d["frames"]) for d in rec.get("defs", ()))
        for th in rec["threads"]:
            if "frames" not in th:
                th["frames"] = table.get(th.get("stack"), ["<unknown stack>"])
    return records


def start_attach_agent() -> None:
    """Start the on-demand agent in this process when FT_AGENT_ATTACH is set (`ft serve` calls
    this, so a service needs only that variable, not PYTHONPATH); never fails the caller."""
    if not settings.agent_attach():
        return
    try:
        from ft.probes.agent.sitecustomize import start

        start()
    except Exception as exc:
        from ft.log import get_logger

        get_logger("ft.probes").warning("stack agent not started: %s", exc)


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0 classic, 1 children only, 2 admin only, 3 none); None without Yama."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


class PtraceDenied(Exception):
    """py-spy could not attach: ptrace is not permitted here."""


class PySpy:
    """`py-spy dump --native --json` of one process; it pauses the target, so it runs sparsely.

    pause=False (a process ft attached to, a live service) reads it with --nonblocking instead:
    the target never stops, at the price of native frames, which py-spy unwinds only paused.
    """

    def __init__(self, native: bool = True, timeout: float = 10.0, pause: bool = True):
        self.exe = shutil.which("py-spy")
        self.native = native and pause
        self.pause = pause
        self.timeout = timeout

    def dump(self, pid: int) -> dict:
        if self.exe is None:
            raise FileNotFoundError("py-spy is not installed")
        cmd = [self.exe, "dump", "--json", "--pid", str(pid)]
        cmd += ["--native"] if self.native else []
        cmd += [] if self.pause else ["--nonblocking"]
        proc = subprocess.run(  # own session: a Ctrl-C must not kill it mid-attach
            cmd, capture_output=True, text=True, timeout=self.timeout, start_new_session=True
        )
        if proc.returncode != 0:
            message = (proc.stderr or proc.stdout).strip().splitlines()
            text = message[-1] if message else f"exit {proc.returncode}"
            if any(word in text.lower() for word in _DENIED):
                raise PtraceDenied(text)
            raise RuntimeError(text)
        return pyspy_record(pid, json.loads(proc.stdout))


def pyspy_record(pid: int, dump: list[dict]) -> dict:
    """py-spy's JSON (leaf-first frames) as the agent's record shape (root-first strings).

    `frames` keeps the Python frames alone, as the agent sees them, so a hot thread's verdict
    names the Python function that burns, not the libc or vdso call it happened to be in
    (with --native, py-spy marks native frames by their `module`). `native` keeps the mixed
    stack for the report's native-stack section.
    """
    threads = []
    for th in dump:
        mixed = [(_frame_name(f), f.get("module") is not None) for f in th["frames"]]
        threads.append(
            {
                "ident": th.get("thread_id"),
                "tid": th.get("os_thread_id"),
                "name": th.get("thread_name"),
                "active": th.get("active"),
                "frames": [name for name, native in reversed(mixed) if not native],
                "native": [name for name, _ in reversed(mixed)],
            }
        )
    return {"kind": "stacks", "source": "py-spy", "t": time.time(), "pid": pid, "threads": threads}


def _frame_name(frame: dict) -> str:
    return f"{frame['name']} ({frame.get('short_filename') or '?'}:{frame.get('line', 0)})"
