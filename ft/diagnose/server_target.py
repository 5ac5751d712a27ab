"""Engine mode: `ft serve` started with the agent, the workload streamed once it is ready.

Plugs into the runner as a ProcessTarget: tick() adds throughput records (the engine's decode
tok/s from /metrics while the workload runs, then the workload's figures), finished() ends the
run when the workload is done, context() tells the findings the strategy.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ft.diagnose.targets import ProcessTarget, exit_text, last_error_line
from ft.errors import FtError

READY = re.compile(r"API server is ready to serve on (\S+):(\d+)")
FIGURES = ("e2e_decode_tok_s", "ttft_s", "engine_decode_tok_s", "throughput_tok_s")
DECODE_RATE = re.compile(r"^ft_decode_tokens_per_second(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class WorkloadSpec:
    prompts: int = 4
    max_tokens: int = 64
    concurrency: int = 1
    seed: int = 0


def _default_workload(base_url: str, spec: WorkloadSpec):
    try:
        from ft.bench.workload import run_workload
    except ImportError as exc:
        raise FtError("engine mode needs the workload client (ft/bench/workload.py)") from exc
    from ft import settings

    return run_workload(base_url, **asdict(spec), api_key=settings.api_key())


class ServerTarget(ProcessTarget):
    label = "server"

    def __init__(self, strategy: str, serve_args: list[str], log_path: Path, spec: WorkloadSpec,
                 command: list[str] | None = None, workload=_default_workload):  # fmt: skip
        command = command or [sys.executable, "-m", "ft", "serve"]  # bisect: a commit's python
        argv = [*command, "--port", "0", "--moe-strategy", strategy, *serve_args]
        super().__init__(argv, log_path)
        self.strategy = strategy
        self.spec = spec
        self.url: str | None = None
        self._workload = workload
        self._thread: threading.Thread | None = None
        self.result = None
        self.error: str | None = None
        self._done_marked = False

    def tick(self) -> list[dict]:
        """Phase marks (findings look at the workload's span only) and the engine's tok/s."""
        if self.url is None:
            self._check_ready()
            return [{"kind": "phase", "t": time.time(), "phase": "workload"}] if self.url else []
        if self._thread is not None and not self._thread.is_alive():
            if self._done_marked:
                return []
            self._done_marked = True
            return [{"kind": "phase", "t": time.time(), "phase": "done"}]
        rate = self._engine_rate()
        return [{"kind": "throughput", "t": time.time(), "tok_s": rate}] if rate is not None else []

    def _check_ready(self) -> None:
        try:
            match = READY.search(self.log_path.read_text(errors="replace"))
        except OSError:
            return
        if match:
            host = match.group(1)
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{match.group(2)}"
            self._thread = threading.Thread(
                target=self._run_workload, name="ft-workload", daemon=True
            )
            self._thread.start()

    def _run_workload(self) -> None:
        try:
            self.result = self._workload(self.url, self.spec)
        except Exception as exc:  # the server died or was stopped: the report says so
            self.error = f"{type(exc).__name__}: {exc}"

    def _engine_rate(self) -> float | None:
        try:
            import httpx

            text = httpx.get(f"{self.url}/metrics", timeout=1.0).text
        except Exception:
            return None
        match = DECODE_RATE.search(text)
        return float(match.group(1)) if match else None

    def finished(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def final_records(self) -> list[dict]:
        """The workload's figures (or why it failed), as the stream's last throughput record."""
        if self.result is None and self.error is None:
            return []
        figures = {k: getattr(self.result, k, None) for k in FIGURES} if self.result else {}
        final = {"kind": "throughput", "t": time.time(), "final": True, "error": self.error}
        return [final | figures]

    def context(self) -> dict:
        facts = {"strategy": self.strategy} | super().context() | {"workload": self.url is not None}
        facts.setdefault("expects_cpu_pool", self.strategy == "hybrid")  # until the log says
        return facts

    def describe(self) -> dict:
        return super().describe() | {"strategy": self.strategy, "workload": asdict(self.spec)}

    def failure(self, exit_code: int | None) -> str | None:
        """A server never exits on its own: any exit before the workload is done failed."""
        if exit_code is None or (self.finished() and self.error is None):
            return None
        when = "during the workload" if self.url else "before it was ready"
        how, line = exit_text(exit_code), last_error_line(self.log_path)
        return f"`ft serve --moe-strategy {self.strategy}` exited with {how} {when}{line}"

    def stop(self, grace: float = 10.0) -> None:
        super().stop(grace)
        if self._thread is not None:
            self._thread.join(timeout=grace)  # the server is gone: the client fails fast
