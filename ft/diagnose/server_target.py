"""Engine mode: `ft serve` started with the agent, the workload streamed once it is ready.

Plugs into the runner as a ProcessTarget: tick() adds throughput records (the engine's decode
tok/s from /metrics while the workload runs, then the workload's figures and the engine's counters
over it), finished() ends the run when the workload is done, context() tells the findings the
strategy. A warm-up request at each concurrency runs first, before the "workload" mark: kernel
compilation and CUDA graph capture happen on an engine's first requests and are not its decode.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
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


def engine_counts(result) -> dict[str, float] | None:
    """The engine's counters over the workload, by short name (`ft_experts_to_cpu_total` ->
    `experts_to_cpu`): the workload client's /metrics deltas; None where it has none."""
    deltas = getattr(result, "engine_counters", None)
    if not deltas:
        return None
    return {n[3:-6]: v for n, v in deltas.items() if n.startswith("ft_") and n.endswith("_total")}


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
        self.counters: dict[str, float] | None = None  # engine counters over the workload
        self._phases: dict[str, float] = {}  # warm-up, workload, done -> when each began
        self._marked: set[str] = set()  # the phases written to the stream

    def tick(self) -> list[dict]:
        """Phase marks (findings look at the workload's span only) and the engine's tok/s."""
        if self.url is None:
            self._check_ready()
        records = self._new_marks()
        if self._marked == {"warm-up", "workload"}:  # the workload runs
            rate = self._engine_rate()
            if rate is not None:
                records.append({"kind": "throughput", "t": time.time(), "tok_s": rate})
        return records

    def _new_marks(self) -> list[dict]:
        """Phases the workload thread reached since the last tick, at the times it reached them."""
        new = [(p, t) for p, t in list(self._phases.items()) if p not in self._marked]
        self._marked.update(p for p, _ in new)
        return [{"kind": "phase", "t": t, "phase": p} for p, t in new]

    def _check_ready(self) -> None:
        try:
            match = READY.search(self.log_path.read_text(errors="replace"))
        except OSError:
            return
        if match:
            host = match.group(1)
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{match.group(2)}"
            self._phases["warm-up"] = time.time()
            self._thread = threading.Thread(
                target=self._run_workload, name="ft-workload", daemon=True
            )
            self._thread.start()

    def _run_workload(self) -> None:
        try:
            self._workload(self.url, replace(self.spec, prompts=self.spec.concurrency))
            self._phases["workload"] = time.time()
            self.result = self._workload(self.url, self.spec)
            self.counters = engine_counts(self.result)
        except Exception as exc:  # the server died or was stopped: the report says so
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._phases["done"] = time.time()

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
        return [final | figures | {"counters": self.counters}]

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
