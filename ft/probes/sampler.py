"""One loop that runs every probe on a target and appends their samples to one JSONL stream."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ft.probes.gpu import GpuProbe
from ft.probes.stacks import AgentReader, PtraceDenied, PySpy
from ft.probes.threads import ThreadProbe, process_tree

# py-spy stops the target for each dump (with --native it unwinds every thread, 50-90 ms on the
# CI box): at most this share of the run in those stops, or a spinning thread reads ~60% CPU and
# the hot-thread finding, the one diagnose exists for, is lost to the probe's own pauses
PYSPY_MAX_PAUSED = 0.1
# Beside the agent, py-spy only adds native frames (the report shows its last dump): a pause
# budget of 1% keeps the probes' cost within issue 37's 2% of decode (docs/performance.md)
PYSPY_MAX_PAUSED_WITH_AGENT = 0.01
PYSPY_EVERY_WITH_AGENT = 5.0  # seconds at least between native dumps beside the agent


@dataclass(frozen=True)
class SamplerConfig:
    interval: float = 0.5  # seconds between thread and GPU samples
    stack_source: str = "auto"  # auto: agent + py-spy where ptrace works; agent; py-spy
    pyspy_every: float = 2.0  # py-spy pauses the target for each dump, so it runs sparsely
    pyspy_pause: bool = True  # False: --nonblocking, for a process ft attached to (a service)
    pyspy_max_paused: float = PYSPY_MAX_PAUSED  # share of the run py-spy may hold the target


def sampler_config(interval: float, stack_source: str, may_pause: bool) -> SamplerConfig:
    """py-spy pauses the target per dump: sparse beside the agent, every interval when alone.
    A target ft attached to is never paused: py-spy reads it --nonblocking, every interval."""
    alone = stack_source == "py-spy" or not may_pause
    if alone:
        return SamplerConfig(interval, stack_source, interval, may_pause)
    every = max(PYSPY_EVERY_WITH_AGENT, 4 * interval)
    return SamplerConfig(interval, stack_source, every, may_pause, PYSPY_MAX_PAUSED_WITH_AGENT)


class Stream:
    """The JSONL file every probe writes to; each line is flushed: a crash loses nothing written."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_stream(path: Path) -> list[dict]:
    """Every complete record of a stream (a torn last line, from a kill, is dropped)."""
    records = []
    with open(path, "rb") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


class Sampler:
    """Call tick() every `interval`; it samples threads, the GPU, the agent's stacks and py-spy."""

    def __init__(self, pid: int, stream: Stream, agent_dir: Path | None, config: SamplerConfig):
        self.pid = pid
        self.stream = stream
        self.config = config
        self.threads = ThreadProbe(pid)
        self.gpu = GpuProbe(pid)
        self.agent = AgentReader(agent_dir) if agent_dir is not None else None
        wants_pyspy = config.stack_source in ("auto", "py-spy")
        self.pyspy = PySpy(pause=config.pyspy_pause) if wants_pyspy else None
        self._pyspy_next = time.monotonic() + min(1.0, config.pyspy_every)  # let the target start
        self._pyspy_skip: set[int] = set()  # processes py-spy cannot read (not Python)

    def tick(self) -> None:
        self.stream.write(self.threads.sample())
        self.stream.write(self.gpu.sample())
        self.drain_agent()
        if self.pyspy is not None and time.monotonic() >= self._pyspy_next:
            start = time.monotonic()
            self._pyspy_round()
            took = time.monotonic() - start  # an upper bound of the pause: py-spy's start too
            wait = max(self.config.pyspy_every, took * (1 / self.config.pyspy_max_paused - 1))
            self._pyspy_next = time.monotonic() + wait

    def drain_agent(self) -> None:
        """Copy the agent's new stack samples into the stream (also called once at the end)."""
        if self.agent is not None:
            for record in self.agent.read_new():
                self.stream.write(record)

    def _pyspy_round(self) -> None:
        for pid in process_tree(self.pid):
            if pid in self._pyspy_skip:
                continue
            try:
                self.stream.write(self.pyspy.dump(pid))
            except PtraceDenied as exc:
                self._event("ptrace-denied", pid=pid, detail=str(exc))
                self.pyspy = None
                return
            except Exception as exc:  # not a Python process, gone, py-spy missing or timed out
                self._pyspy_skip.add(pid)
                self._event("py-spy-failed", pid=pid, detail=f"{type(exc).__name__}: {exc}")

    def _event(self, name: str, **fields) -> None:
        self.stream.write({"kind": "event", "t": time.time(), "event": name} | fields)

    def close(self) -> None:
        self.drain_agent()
        self.gpu.close()
