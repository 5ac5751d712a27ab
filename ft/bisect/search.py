"""The search: endpoints first, then the range cut N+1 ways, then the culprit confirmed.
Who measures what, and under which conditions, is ft/bisect/schedule.py's business.

Commits are indexed oldest first, 0 = GOOD, n-1 = BAD. Each round measures up to --jobs commits
at once, evenly spaced among the untested ones between the last good and the first bad:

    jobs=1   [G ? ? ? ? ? ? B]  ->  [G ? ? g ? ? ? B]  ->  [G ? ? g ? b ? B]  ...
                      ^ cut              the good half falls away
    jobs=3   [G ? ? ? ? ? ? ? B]  ->  [G ? g ? b ? b ? B]  ->  [G ? g ? b B]
                  ^   ^   ^   (4 parts)     next round only between g and the first b

Skipped and unknown commits are never cut at again; if one sits between the last good and the
first bad, the answer is the range of commits the culprit could be in. Whatever the search
narrowed to, fresh interleaved samples of its two edges must show the change again: `found`
only when they do (Outcome lists the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ft.bisect.config import BisectConfig
from ft.bisect.gitrepo import PatchStack, Scratch
from ft.bisect.judge import Judge
from ft.bisect.measure import Measurer
from ft.bisect.schedule import Scheduler
from ft.bisect.stats import Effect, classify, effect, median, rank_p
from ft.bisect.store import SampleStore
from ft.bisect.verdict import Outcome, Verdict
from ft.errors import FtError
from ft.report import plural


@dataclass
class CommitState:
    sha: str
    verdict: Verdict | None = None
    p_good: float | None = None
    p_bad: float | None = None
    reason: str | None = None  # why skipped / unknown


@dataclass
class Confirmation:
    confirmed: bool
    effect: Effect | None
    note: str


@dataclass
class BisectResult:
    states: list[CommitState]
    lo: int  # last good
    hi: int  # first bad
    direction: str  # "higher" or "lower": which way is worse
    endpoints: Effect
    outcome: Outcome
    message: str
    confirmation: Confirmation | None = None
    taken: int = 0  # samples measured by this run (the rest were read back)
    skipped: list[int] = field(default_factory=list)

    @property
    def candidates(self) -> list[str]:
        return [s.sha for s in self.states[self.lo + 1 : self.hi + 1]]


class Bisector:
    def __init__(
        self,
        commits: list[str],
        scratch: Scratch,
        stack: PatchStack,
        judge: Judge,
        store: SampleStore,
        config: BisectConfig,
        log: Callable[[str], None] = lambda msg: None,
        gpus: list[str] | None = None,
        measurer: Measurer | None = None,
    ):
        self.states = [CommitState(sha) for sha in commits]
        self.cfg, self.store, self.log = config, store, log
        self.measurer = measurer or Measurer(scratch, stack, judge, store, log, gpus, config.jobs)
        self.schedule = Scheduler(self.measurer, commits[0], commits[-1], config.jobs, log)

    # --- the endpoints (mozregression: check both ends before anything else) ---------------
    def endpoints(self) -> int | None:
        """Both ends on every worker, doubled until they differ on each; the worker on which
        they still do not differ at --max-repeats, else None."""
        target = min(2 * self.cfg.repeats, self.cfg.max_repeats)
        for state in (self.states[0], self.states[-1]):  # one that failed last time: again
            self.store.clear_skip(state.sha)
        while True:
            self.schedule.measure_endpoints(target)
            for state in (self.states[0], self.states[-1]):
                if reason := self.store.skip_reason(state.sha):
                    raise FtError(f"endpoint {state.sha[:10]} could not be measured: {reason}")
            alike = [w for w in self.schedule.workers if not self._ends_differ(w)]
            if not alike:
                self.states[0].verdict, self.states[-1].verdict = Verdict.GOOD, Verdict.BAD
                return None
            if target >= self.cfg.max_repeats:
                return alike[0]
            target = min(2 * target, self.cfg.max_repeats)

    def _ends_differ(self, worker: int) -> bool:
        return rank_p(*self.schedule.references(worker)) < self.cfg.alpha

    # --- the search -------------------------------------------------------------------------
    def run(self) -> BisectResult:
        try:
            return self._search()
        finally:
            self.measurer.release_all()

    def _search(self) -> BisectResult:
        alike = self.endpoints()
        good, bad = self.schedule.references()
        direction = "higher" if median(bad) > median(good) else "lower"
        last = len(self.states) - 1
        if alike is not None:
            return self._result(0, last, direction, Outcome.NO_CHANGE, self._no_change(alike))
        self.log(
            f"endpoints: good {median(good):.4g}, bad {median(bad):.4g} ({direction} is worse)"
        )
        lo, hi = 0, last
        while untested := [i for i in range(lo + 1, hi) if self.states[i].verdict is None]:
            picks = cut_points(untested, self.cfg.jobs)
            self.log(f"{plural(len(untested), 'commit')} left to test; measuring {len(picks)}")
            self._judge_many(picks)
            lo, hi = self._bounds()
            if len(self._skipped()) > self.cfg.max_skips:
                return self._result(lo, hi, direction, Outcome.ABORTED, self._too_many(lo, hi))
        conf = self._confirm(lo, hi, direction)
        outcome = self._outcome(lo, hi, conf)
        result = self._result(lo, hi, direction, outcome, self._message(lo, hi, outcome, conf))
        result.confirmation = conf
        return result

    def _judge_many(self, picks: list[int]) -> None:
        def judge_one(i: int, worker: int) -> None:
            state, target = self.states[i], self.cfg.repeats
            while True:
                self.measurer.ensure(state.sha, target, "search", worker)
                reason = self.store.skip_reason(state.sha)
                if reason:
                    state.verdict, state.reason = Verdict.SKIP, reason
                    break
                good, bad = self.schedule.references(worker)
                xs = self.schedule.values(state.sha, worker=worker)
                c = classify(xs, good, bad, self.cfg.alpha)
                state.verdict, state.p_good, state.p_bad = c.verdict, c.p_good, c.p_bad
                if c.verdict != Verdict.UNKNOWN or target >= self.cfg.max_repeats:
                    break
                target = min(2 * target, self.cfg.max_repeats)
            if state.verdict == Verdict.UNKNOWN:
                p_values = f"p={c.p_good:.2g} vs GOOD, {c.p_bad:.2g} vs BAD"
                state.reason = f"between GOOD and BAD after {target} samples ({p_values})"
            reason = f": {state.reason}" if state.reason else ""
            self.log(f"{state.sha[:10]}: {state.verdict.value}{reason}")

        self.schedule.judge([partial(judge_one, i) for i in picks])

    def _bounds(self) -> tuple[int, int]:
        verdicts = [s.verdict for s in self.states]
        hi = verdicts.index(Verdict.BAD)
        lo = max(i for i in range(hi) if verdicts[i] == Verdict.GOOD)
        return lo, hi

    def _skipped(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.verdict == Verdict.SKIP]

    def _outcome(self, lo: int, hi: int, conf: Confirmation) -> Outcome:
        if not conf.confirmed:
            return Outcome.UNCONFIRMED
        if hi - lo == 1:
            return Outcome.FOUND
        between = [s.verdict for s in self.states[lo + 1 : hi]]
        return Outcome.AMBIGUOUS if Verdict.UNKNOWN in between else Outcome.RANGE

    # --- what the evidence supports, in words ------------------------------------------------
    def _message(self, lo: int, hi: int, outcome: Outcome, conf: Confirmation) -> str:
        n, after = hi - lo, self.states[lo].sha[:10]
        cands = ", ".join(s.sha[:10] for s in self.states[lo + 1 : hi + 1])
        if outcome == Outcome.FOUND:
            return f"first bad commit: {self.states[hi].sha}"
        if outcome == Outcome.UNCONFIRMED:
            points = f"{self.states[hi].sha[:10]}" if n == 1 else f"{n} commits ({cands})"
            return f"not confirmed: the search points at {points} after {after}, but {conf.note}"
        if outcome == Outcome.RANGE:
            return f"the culprit is one of {n} commits after {after} ({cands}): neighbours skipped"
        unknown = sum(s.verdict == Verdict.UNKNOWN for s in self.states[lo + 1 : hi])
        return (
            f"the culprit is one of {n} commits after {after} ({cands}): "
            f"{plural(unknown, 'commit')} between stayed between GOOD and BAD at --max-repeats "
            f"{self.cfg.max_repeats} (a partial change, or too noisy to tell)"
        )

    def _too_many(self, lo: int, hi: int) -> str:
        skipped = self._skipped()
        first = self.states[skipped[0]]
        return (
            f"too many commits could not be measured ({len(skipped)} > --max-skips "
            f"{self.cfg.max_skips}), e.g. {first.sha[:10]}: {first.reason}; "
            f"the culprit is among {plural(hi - lo, 'commit')} after {self.states[lo].sha[:10]}"
        )

    def _no_change(self, worker: int) -> str:
        g, b = self.schedule.references(worker)
        where = f" on worker {worker}" if self.cfg.jobs > 1 else ""
        return (
            f"GOOD {self.states[0].sha[:10]} and BAD {self.states[-1].sha[:10]} do not differ "
            f"significantly{where} (Mann-Whitney p={rank_p(g, b):.3g}): good {_fmt(g)} vs bad "
            f"{_fmt(b)}"
        )

    def _result(self, lo, hi, direction, outcome, message) -> BisectResult:
        return BisectResult(
            self.states, lo, hi, direction, effect(*self.schedule.references()), outcome,
            message, taken=self.measurer.taken, skipped=self._skipped(),
        )  # fmt: skip

    # --- confirmation (Pinpoint): fresh samples of both sides, interleaved --------------------
    def _confirm(self, lo: int, hi: int, direction: str) -> Confirmation:
        before, after = self.states[lo].sha, self.states[hi].sha
        target = min(2 * self.cfg.repeats, self.cfg.max_repeats)
        while True:
            failed = self.schedule.confirm(before, after, target)
            if failed:
                return Confirmation(False, None, f"could not re-measure {failed}")
            b, a = self.schedule.confirm_samples(before, after)
            eff = effect(b, a)
            worse = (eff.delta > 0) == (direction == "higher")
            samples = f"{len(b)}+{len(a)} fresh interleaved samples"
            if eff.p < self.cfg.alpha and worse:
                return Confirmation(True, eff, f"confirmed on {samples}, p={eff.p:.2g}")
            if target >= self.cfg.max_repeats:
                change = "show the opposite change" if eff.p < self.cfg.alpha else "do not differ"
                return Confirmation(False, eff, f"{samples} of the two {change} (p={eff.p:.2g})")
            target = min(2 * target, self.cfg.max_repeats)


def cut_points(untested: list[int], jobs: int) -> list[int]:
    """`jobs` indices splitting the untested ones into jobs+1 even parts (all if few)."""
    if len(untested) <= jobs:
        return list(untested)
    n = len(untested)
    return sorted({untested[(k + 1) * n // (jobs + 1)] for k in range(jobs)})


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"
