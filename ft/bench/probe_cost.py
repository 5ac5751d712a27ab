"""What `ft diagnose`'s probes cost the target: one workload, with and without them, alternated.

Runs alternate with and without probes, A B A C A D A ... (pyperf / asv style): each probed run
sits between two runs without probes, its own reference, so a box that warms up or slows down
over the benchmark moves both alike. Each probed setting (a stack source at the default or a
fast interval) runs once per round, the order rotated round by round, all against one warm
server (the model loads once). Per probed run i:

    overhead_i = 1 - tok/s(run i) / mean(tok/s of the runs without probes just before and after)
    (for a cost such as CPU ms per token: cost(run i) / mean(...) - 1; positive is worse)

quoted per setting as the mean over rounds with its 95% interval (Student's t, scipy.stats).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field

BASELINE = "none"
RATES = ("e2e_decode_tok_s", "engine_decode_tok_s")  # higher is better
# the target's own CPU time per decoded token (its agent thread included): on a shared box it
# moves far less with the neighbours' load than tok/s does
COSTS = ("server_cpu_ms_per_token",)  # lower is better
METRICS = RATES + COSTS


@dataclass(frozen=True)
class ProbeSetting:
    """One way of probing: the stack source (None: no probes) and its sampling intervals."""

    name: str
    stack_source: str | None
    interval: float = 0.5  # threads and GPU
    agent_interval: float = 0.1

    def to_json(self) -> dict:
        return asdict(self)


def probe_settings(
    sources: Iterable[str], interval: float, agent_interval: float, fast: float | None
) -> list[ProbeSetting]:
    """No probes first, then each source at the default intervals and, with `fast`, with both
    intervals divided by `fast` (5: threads every 0.1 s, agent every 0.02 s)."""
    out = [ProbeSetting(BASELINE, None, interval, agent_interval)]
    for source in sources:
        out.append(ProbeSetting(source, source, interval, agent_interval))
        if fast:
            name = f"{source} fast"
            out.append(ProbeSetting(name, source, interval / fast, agent_interval / fast))
    return out


def schedule(settings: list[ProbeSetting], repeats: int) -> list[tuple[int, ProbeSetting]]:
    """(round, setting) in run order: the baseline (settings[0]) before every probed run and
    once more at the end; the probed settings rotated by one each round (B C D, C D B, ...)."""
    base, probed = settings[0], settings[1:]
    n = len(probed)
    order = []
    for r in range(repeats):
        for k in range(n):
            order += [(r, base), (r, probed[(r + k) % n])]
    return order + [(repeats - 1, base)]


@dataclass
class Trial:
    round: int
    setting: str
    figures: dict[str, float | None]
    samples: dict[str, float] = field(default_factory=dict)  # records each probe wrote, ...
    seconds: float = 0.0  # the workload's wall time


@dataclass(frozen=True)
class Overhead:
    """A setting's cost against no probes for one metric: fractions, positive = slower."""

    setting: str
    metric: str
    median: float | None  # the setting's median tok/s
    spread: float | None  # (max - min) / median of its rounds
    overhead: float | None  # mean of the paired overheads
    low: float | None  # 95% interval of that mean
    high: float | None
    rounds: int


def run_trials(
    settings: list[ProbeSetting],
    repeats: int,
    measure: Callable[[], dict[str, float | None]],
    probes: Callable[[ProbeSetting], AbstractContextManager[dict[str, int]]],
    on_trial: Callable[[Trial], None] = lambda trial: None,
) -> list[Trial]:
    """Run the workload (`measure`) once per (round, setting), inside that setting's probes.

    `probes(setting)` is entered around the measurement; what it yields is filled, on exit,
    with the number of records each probe wrote."""
    trials = []
    for rnd, setting in schedule(settings, repeats):
        with probes(setting) as samples:
            start = time.monotonic()
            figures = measure()
            seconds = time.monotonic() - start
        trial = Trial(rnd, setting.name, figures, dict(samples), round(seconds, 3))
        trials.append(trial)
        on_trial(trial)
    return trials


def overheads(trials: list[Trial], metric: str) -> list[Overhead]:
    """Each probed setting's overhead against the baseline of its own rounds."""
    names = list(dict.fromkeys(t.setting for t in trials if t.setting != BASELINE))
    out = []
    for name in names:
        runs = [(i, t.figures.get(metric)) for i, t in enumerate(trials) if t.setting == name]
        values = [v for _, v in runs if v]
        refs = [(v, _reference(trials, i, metric)) for i, v in runs]
        sign = -1 if metric in COSTS else 1
        paired = [sign * (1 - v / ref) for v, ref in refs if v and ref]
        low, high = _interval(paired)
        out.append(
            Overhead(
                setting=name,
                metric=metric,
                median=statistics.median(values) if values else None,
                spread=_spread(values),
                overhead=statistics.fmean(paired) if paired else None,
                low=low,
                high=high,
                rounds=len(paired),
            )
        )
    return out


def baseline_figures(trials: list[Trial], metric: str) -> dict[str, float | None]:
    """Median and spread of the runs without probes."""
    values = [v for t in trials if t.setting == BASELINE and (v := t.figures.get(metric))]
    return {"median": statistics.median(values) if values else None, "spread": _spread(values)}


def probe_cpu_share(trials: list[Trial]) -> dict[str, float]:
    """Per probed setting, ft's own CPU time probing (`probe_cpu_ms`) over the workloads' wall
    time: the share of one core the probes take from a box whose cores the target fills."""
    out = {}
    for name in dict.fromkeys(t.setting for t in trials if t.setting != BASELINE):
        runs = [t for t in trials if t.setting == name and "probe_cpu_ms" in t.samples]
        wall = sum(t.seconds for t in runs)
        if wall > 0:
            out[name] = sum(t.samples["probe_cpu_ms"] for t in runs) / 1000 / wall
    return out


def _reference(trials: list[Trial], at: int, metric: str) -> float | None:
    """Mean tok/s of the nearest runs without probes before and after run `at`."""
    before = next((t for t in reversed(trials[:at]) if t.setting == BASELINE), None)
    after = next((t for t in trials[at + 1 :] if t.setting == BASELINE), None)
    values = [v for t in (before, after) if t is not None and (v := t.figures.get(metric))]
    return statistics.fmean(values) if values else None


def _spread(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def _interval(paired: list[float]) -> tuple[float | None, float | None]:
    """Student's t 95% interval of the mean: honest at the few rounds a benchmark affords,
    where a bootstrap's percentile interval comes out too narrow; None below 3 rounds."""
    if len(paired) < 3:
        return None, None
    if max(paired) == min(paired):
        return paired[0], paired[0]
    from scipy.stats import ttest_1samp

    interval = ttest_1samp(paired, 0.0).confidence_interval(0.95)
    return float(interval.low), float(interval.high)
