"""The probes of `ft diagnose`, run on a server `ft bench probes` started, for one trial.

The server runs the on-demand agent (FT_AGENT_ATTACH), so one warm server serves every
setting: the agent samples only while a trial asks it to, at the trial's interval, with the
same sampling code the injected agent runs. py-spy pauses the server as it would a target ft
started (`ft diagnose --strategy`), with the same pause budget (ft/probes/sampler.py).
"""

from __future__ import annotations

import resource
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ft.bench.probe_cost import ProbeSetting
from ft.probes.agent_session import AgentSession
from ft.probes.sampler import Sampler, Stream, sampler_config
from ft.probes.threads import process_tree


class _Counting(Stream):
    """A stream that also counts its records by kind (and stack source)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.counts: Counter = Counter()

    def write(self, record: dict) -> None:
        kind = record.get("kind", "?")
        self.counts[f"{kind}:{record['source']}" if kind == "stacks" else kind] += 1
        super().write(record)


@contextmanager
def live_probes(pid: int, agent_folder: Path, setting: ProbeSetting) -> Iterator[dict[str, float]]:
    """Sample `pid` as `ft diagnose` would while the block runs; yields the record counts and,
    as probe_cpu_ms, the CPU time ft spent probing (its sampling thread and py-spy's runs)."""
    samples: dict[str, float] = {}
    if setting.stack_source is None:
        yield samples
        return
    with tempfile.TemporaryDirectory(prefix="ft-probe-cost-") as tmp:
        stream = _Counting(Path(tmp) / "samples.jsonl")
        config = sampler_config(setting.interval, setting.stack_source, may_pause=True)
        sampler = Sampler(pid, stream, None, config)
        session = None
        if setting.stack_source != "py-spy":
            session = AgentSession(agent_folder, setting.agent_interval, shared=False)
            session.open()
            _until_answered(session, pid, stream)
        stop = threading.Event()
        spent: list[float] = []
        loop_args = (sampler, session, stream, setting.interval, stop, spent)
        children = _children_cpu_s()
        thread = threading.Thread(target=_loop, args=loop_args, daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            stop.set()
            thread.join()
            for record in session.close() if session is not None else []:
                stream.write(record)
            sampler.close()
            stream.close()
            samples.update(stream.counts)
            pyspy_s = _children_cpu_s() - children  # py-spy: the only children that end here
            samples["probe_cpu_ms"] = round(1000 * (sum(spent) + pyspy_s), 1)


def _until_answered(session: AgentSession, pid: int, stream: Stream, wait_s: float = 5.0) -> None:
    """The agent looks for requests once a second: a trial starts once it samples, or it
    would measure a second of no agent at all."""
    deadline = time.monotonic() + wait_s
    session.ask(process_tree(pid))
    while not session.answered and session.error is None and time.monotonic() < deadline:
        for record in session.read():
            stream.write(record)
        time.sleep(0.05)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _loop(sampler: Sampler, session, stream: Stream, interval: float, stop, spent) -> None:
    """runner._loop's sampling, minus the target's own records; its CPU time goes to `spent`."""
    start = time.thread_time()
    while not stop.is_set():
        tick_at = time.monotonic()
        sampler.tick()
        if session is not None:
            session.ask(process_tree(sampler.pid))
            for record in session.read():
                stream.write(record)
        stop.wait(max(0.0, interval - (time.monotonic() - tick_at)))
    spent.append(time.thread_time() - start)
