"""Run a target under the probes until it ends, the duration passes or a signal comes; then report.

Whatever stops the run (the target exiting or crashing, SIGINT, SIGTERM, SIGHUP), the target is
resumed and stopped and the report is written from the samples gathered so far.
"""

from __future__ import annotations

import os
import select
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ft.cpuinfo import allowed_cores  # the target inherits ft's affinity
from ft.diagnose.targets import ProcessTarget
from ft.errors import FtError
from ft.log import get_logger
from ft.probes.env import collect
from ft.probes.sampler import Sampler, Stream, sampler_config
from ft.probes.stacks import STACK_SOURCES, agent_env, ptrace_scope

SCHEMA = 1
STREAM = "samples.jsonl"
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s)


@dataclass(frozen=True)
class DiagnoseConfig:
    out_dir: Path
    duration: float = 10.0  # seconds of sampling at most
    interval: float = 0.5  # seconds between thread and GPU samples
    stack_source: str = "auto"
    agent_interval: float = 0.1  # ~1 ms of GIL per sample for 40 threads: ~1% of the target

    def __post_init__(self):
        if self.stack_source not in STACK_SOURCES:
            raise FtError(f"--stack-source must be one of {', '.join(STACK_SOURCES)}")
        if self.duration <= 0 or self.interval <= 0:
            raise FtError("--duration and --interval must be positive")


@dataclass
class RunOutcome:
    stream: Path
    stopped_by: str  # "duration", "target-exit", "finished", "SIGINT", ...
    exit_code: int | None
    signal_num: int | None = None
    notes: list[str] = field(default_factory=list)
    failure: str | None = None  # the target failed: how, with its own last error line


class StopSignal:
    """The first of SIGINT/SIGTERM/SIGHUP, as the sampling loop sees it.

    A Python signal handler runs between two bytecodes of the main thread, and that can be inside
    `threading.Event.wait` with the event's lock held: `Event.set` in the handler then waits for
    that lock forever (ft hung, the report unwritten). So the handler takes no lock: it notes the
    signal and writes a byte to a pipe that `wait` sleeps on.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self, signum: int) -> None:
        self.received.append(signum)
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full of earlier signals' bytes: awake already
            pass

    def is_set(self) -> bool:
        return bool(self.received)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, less if a signal comes (or came) meanwhile."""
        if not self.is_set():
            select.select([self._read], [], [], timeout)
        return self.is_set()

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


@contextmanager
def _caught_signals():
    """SIGINT/SIGTERM/SIGHUP set a StopSignal instead of killing ft: the report gets written."""
    stop = StopSignal()

    def handler(signum, _frame):
        for s in _SIGNALS:  # one stop is all they ask; a burst would nest handlers without end
            signal.signal(s, signal.SIG_IGN)
        stop.set(signum)

    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        stop.close()


def diagnose(target: ProcessTarget, config: DiagnoseConfig) -> tuple[RunOutcome, dict]:
    """Run, then write the report; signals stay caught until the report is on disk."""
    from ft.diagnose.report import write_report

    with _caught_signals() as stop:
        outcome = run(target, config, stop)
        return outcome, write_report(config.out_dir, outcome)


def run(target: ProcessTarget, config: DiagnoseConfig, stop: StopSignal) -> RunOutcome:
    out = config.out_dir
    _check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    stream = Stream(out / STREAM)
    agent_dir = None if config.stack_source == "py-spy" else out / "agent"
    env = dict(os.environ)
    if agent_dir is not None:
        agent_dir.mkdir(exist_ok=True)
        env = agent_env(env, agent_dir, config.agent_interval)
    start = {"kind": "start", "schema": SCHEMA, "t": time.time(), "target": target.describe()}
    context = {"ptrace_scope": ptrace_scope()} | target.context()
    stream.write(
        start | {"config": asdict(config), "context": context, "cores": len(allowed_cores())}
    )
    stream.write({"kind": "env", "t": time.time(), "env": collect(light=True)})
    try:
        outcome = _sample(target, config, stream, agent_dir, env, stop)
        end = {"stopped_by": outcome.stopped_by, "exit_code": outcome.exit_code}
        stream.write({"kind": "end", "t": time.time(), "context": context | target.context()} | end)
    finally:
        stream.close()
    return outcome


def _check_out_dir(out: Path) -> None:
    """One run per folder: appending to an earlier run's samples would mix two runs' numbers."""
    if out.exists() and not out.is_dir():
        raise FtError(f"--out {out} is a file, not a folder")
    if (out / STREAM).exists():
        raise FtError(f"--out {out} already holds a diagnose run; give a new folder")


def _loop(target, config, sampler, stream, stop) -> str:
    """Sample every interval until a signal, the target's exit or end of work, or the deadline."""
    deadline = time.monotonic() + config.duration
    while True:
        tick_at = time.monotonic()
        sampler.tick()
        for record in target.tick():
            stream.write(record)
        if stop.is_set():
            return signal.Signals(stop.first).name
        if target.exited():
            return "target-exit"
        if target.finished():
            return "finished"
        if time.monotonic() >= deadline:
            return "duration"
        stop.wait(max(0.0, config.interval - (time.monotonic() - tick_at)))


def _sample(target, config, stream, agent_dir, env, stop) -> RunOutcome:
    if stop.is_set():  # a signal came while ft was still collecting the environment
        return RunOutcome(stream.path, signal.Signals(stop.first).name, None, stop.first)
    pid = target.start(env)
    sampler = None
    stopped_by = "duration"
    try:
        sampler = Sampler(
            pid,
            stream,
            agent_dir,
            sampler_config(config.interval, config.stack_source, target.may_pause),
        )
        stopped_by = _loop(target, config, sampler, stream, stop)
    except FtError:
        raise
    except Exception as exc:  # a probe's bug must not cost the samples already taken
        get_logger("ft.diagnose").warning("sampling stopped: %s: %s", type(exc).__name__, exc)
        stream.write({"kind": "event", "t": time.time(), "event": "ft-error", "detail": repr(exc)})
        stopped_by = "ft-error"
    finally:
        target.stop()
        for record in target.final_records():
            stream.write(record)
        if sampler is not None:
            sampler.close()  # the agent's last lines, written up to the target's end
    code = target.poll()
    get_logger("ft.diagnose").debug("run stopped by %s, exit %s", stopped_by, code)
    sig = stop.first
    exit_code = code if stopped_by == "target-exit" else None
    failure = target.failure(exit_code)
    return RunOutcome(stream.path, stopped_by, exit_code, sig, failure=failure)
