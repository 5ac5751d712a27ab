"""The search: endpoints first, then the range cut N+1 ways, then the culprit confirmed.

Commits are indexed oldest first, 0 = GOOD, n-1 = BAD. Each round measures up to --jobs commits
at once, evenly spaced among the untested ones between the last good and the first bad:

    jobs=1   [G ? ? ? ? ? ? B]  ->  [G ? ? g ? ? ? B]  ->  [G ? ? g ? b ? B]  ...
                      ^ cut              the good half falls away
    jobs=3   [G ? ? ? ? ? ? ? B]  ->  [G ? g ? b ? b ? B]  ->  [G ? g ? b B]
                  ^   ^   ^   (4 parts)     next round only between g and the first b

Skipped and unknown commits are never cut at again; if one sits between the last good and the
first bad, the answer is the range of commits the culprit could be in.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ft.bisect.config import BisectConfig
from ft.bisect.gitrepo import PatchStack, Scratch
from ft.bisect.judge import Judge
from ft.bisect.measure import Measurer
from ft.bisect.stats import Effect, classify, effect, median, rank_p
from ft.bisect.store import SampleStore
from ft.bisect.verdict import Outcome, Verdict
from ft.errors import FtError


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
    ):
        self.states = [CommitState(sha) for sha in commits]
        self.cfg, self.store, self.log = config, store, log
        self.measurer = Measurer(scratch, stack, judge, store, log, gpus)

    # --- the endpoints (mozregression: check both ends before anything else) ---------------
    def endpoints(self) -> tuple[list[float], list[float]]:
        good, bad = self.states[0].sha, self.states[-1].sha
        target = min(2 * self.cfg.repeats, self.cfg.max_repeats)
        for sha in (good, bad):  # an endpoint that failed last time is tried again
            self.store.clear_skip(sha)
        while True:
            self._parallel([(good, target, "search"), (bad, target, "search")])
            for state in (self.states[0], self.states[-1]):
                reason = self.store.skip_reason(state.sha)
                if reason:
                    raise FtError(f"endpoint {state.sha[:10]} could not be measured: {reason}")
            g, b = self.store.values(good, "search"), self.store.values(bad, "search")
            if rank_p(g, b) < self.cfg.alpha:
                break
            if target >= self.cfg.max_repeats:
                raise FtError(
                    f"GOOD {good[:10]} and BAD {bad[:10]} do not differ significantly "
                    f"(Mann-Whitney p={rank_p(g, b):.3g}): good {_fmt(g)} vs bad {_fmt(b)}"
                )
            target = min(2 * target, self.cfg.max_repeats)
        self.states[0].verdict, self.states[-1].verdict = Verdict.GOOD, Verdict.BAD
        return g, b

    # --- the search -------------------------------------------------------------------------
    def run(self) -> BisectResult:
        good, bad = self.endpoints()
        direction = "higher" if median(bad) > median(good) else "lower"
        self.log(
            f"endpoints: good {median(good):.4g}, bad {median(bad):.4g} ({direction} is worse)"
        )
        lo, hi = 0, len(self.states) - 1
        while untested := [i for i in range(lo + 1, hi) if self.states[i].verdict is None]:
            picks = cut_points(untested, self.cfg.jobs)
            self.log(f"{hi - lo - 1} commits left between good and bad; measuring {len(picks)}")
            self._judge_many(picks, good, bad)
            lo, hi = self._bounds()
            if len(self._skipped()) > self.cfg.max_skips:
                return self._result(lo, hi, direction, good, bad, Outcome.ABORTED)
        outcome = Outcome.FOUND if hi - lo == 1 else Outcome.RANGE
        result = self._result(lo, hi, direction, good, bad, outcome)
        result.confirmation = self._confirm(lo, hi, direction)
        result.taken = self.measurer.taken
        return result

    def _judge_many(self, picks: list[int], good: list[float], bad: list[float]) -> None:
        def judge_one(slot: int, i: int) -> None:
            state, target = self.states[i], self.cfg.repeats
            while True:
                self.measurer.ensure(state.sha, target, "search", slot)
                reason = self.store.skip_reason(state.sha)
                if reason:
                    state.verdict, state.reason = Verdict.SKIP, reason
                    break
                c = classify(self.store.values(state.sha, "search"), good, bad, self.cfg.alpha)
                state.verdict, state.p_good, state.p_bad = c.verdict, c.p_good, c.p_bad
                if c.verdict != Verdict.UNKNOWN or target >= self.cfg.max_repeats:
                    break
                target = min(2 * target, self.cfg.max_repeats)
            if state.verdict == Verdict.UNKNOWN:
                state.reason = f"unknown after {target} samples (p={c.p_good:.2g}/{c.p_bad:.2g})"
            self.measurer.release(slot)
            self.log(f"{state.sha[:10]}: {state.verdict.value} {state.reason or ''}".rstrip())

        self._run_all([lambda slot=slot, i=i: judge_one(slot, i) for slot, i in enumerate(picks)])

    def _parallel(self, jobs: list[tuple[str, int, str]]) -> None:
        """Measure several commits at once, one worker slot each (the endpoints)."""
        width = max(1, min(self.cfg.jobs, len(jobs)))
        slots: list[list[tuple[str, int, str]]] = [jobs[k::width] for k in range(width)]

        def work(slot: int) -> None:
            for sha, n, phase in slots[slot]:
                self._ensure_and_release(sha, n, phase, slot)

        self._run_all([lambda slot=slot: work(slot) for slot in range(width)])

    def _run_all(self, calls: list[Callable[[], None]]) -> None:
        """Run on worker threads; on Ctrl-C or a failure, stop the others and kill their
        commands (their samples in flight are dropped; every finished one is on disk)."""
        pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="ft-bisect")
        futures = [pool.submit(call) for call in calls]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            self.measurer.abort()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _ensure_and_release(self, sha: str, n: int, phase: str, slot: int) -> None:
        self.measurer.ensure(sha, n, phase, slot)
        self.measurer.release(slot)

    def _bounds(self) -> tuple[int, int]:
        verdicts = [s.verdict for s in self.states]
        hi = verdicts.index(Verdict.BAD)
        lo = max(i for i in range(hi) if verdicts[i] == Verdict.GOOD)
        return lo, hi

    def _skipped(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.verdict == Verdict.SKIP]

    def _result(self, lo, hi, direction, good, bad, outcome) -> BisectResult:
        cands = ", ".join(s.sha[:10] for s in self.states[lo + 1 : hi + 1])
        if outcome == Outcome.ABORTED:
            skipped = self._skipped()
            message = (
                f"too many commits could not be measured ({len(skipped)} > --max-skips "
                f"{self.cfg.max_skips}), e.g. {self.states[skipped[0]].sha[:10]}: "
                f"{self.states[skipped[0]].reason}; the culprit is among {hi - lo} commits "
                f"after {self.states[lo].sha[:10]}"
            )
        elif outcome == Outcome.FOUND:
            message = f"first bad commit: {self.states[hi].sha}"
        else:
            message = f"the culprit is one of {hi - lo} commits ({cands}): neighbours skipped"
        return BisectResult(
            self.states, lo, hi, direction, effect(good, bad), outcome, message,
            taken=self.measurer.taken, skipped=self._skipped(),
        )  # fmt: skip

    # --- confirmation (Pinpoint): fresh samples of both sides, interleaved --------------------
    def _confirm(self, lo: int, hi: int, direction: str) -> Confirmation:
        before, after = self.states[lo].sha, self.states[hi].sha
        target = min(2 * self.cfg.repeats, self.cfg.max_repeats)
        while True:
            skip = self.measurer.interleave(before, after, target)
            if skip:
                return Confirmation(False, None, f"could not re-measure: {skip}")
            b, a = self.store.values(before, "confirm"), self.store.values(after, "confirm")
            eff = effect(b, a)
            worse = (eff.delta > 0) == (direction == "higher")
            if eff.p < self.cfg.alpha and worse:
                note = f"confirmed on {len(b)}+{len(a)} fresh interleaved samples, p={eff.p:.2g}"
                return Confirmation(True, eff, note)
            if target >= self.cfg.max_repeats:
                note = f"NOT confirmed: re-measured {len(b)}+{len(a)} samples, p={eff.p:.2g}"
                return Confirmation(False, eff, note)
            target = min(2 * target, self.cfg.max_repeats)


def cut_points(untested: list[int], jobs: int) -> list[int]:
    """`jobs` indices splitting the untested ones into jobs+1 even parts (all if few)."""
    if len(untested) <= jobs:
        return list(untested)
    n = len(untested)
    return sorted({untested[(k + 1) * n // (jobs + 1)] for k in range(jobs)})


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"
