"""Rank tests on raw samples (Chromium Pinpoint's way): same / different / unknown.

A commit is compared with BOTH endpoints. Its median's place on the way from GOOD's median (0)
to BAD's (1), on a log scale, says which it looks like; the rank test against the other
endpoint says whether that is more than noise. BAD = in the last third and significantly
different from GOOD; GOOD symmetrically; otherwise UNKNOWN, and the driver doubles its samples
up to --max-repeats (a commit that stays in the middle third is a partial change: it stays
UNKNOWN). "Not different from the near endpoint" is deliberately not required: with many
samples any commit differs a little from an endpoint measured a few times.

Mann-Whitney U needs no normality and shrugs off the odd outlier a busy box produces; the
price is that tiny samples can never be significant (3 vs 3 gives at best p = 0.1), which is
why the endpoints, reused by every comparison, get twice the repeats.

The place is measured on a log scale because speed changes multiply: on a 7x regression
(145 -> 17 tok/s) a good commit whose server happens to run 30% slow (98 tok/s, as a 2-core CI
box gave) sits a third of the way along a straight line, but a fifth of the way in ratios.
For small changes the two scales agree.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from ft.bisect.verdict import Verdict

ALPHA = 0.05  # two-sided significance of "differs"
CONFIDENCE = 0.95  # of the effect-size interval


def rank_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value; 1.0 where there is nothing to compare."""
    if len(a) == 0 or len(b) == 0 or (len(set(a)) == 1 and set(a) == set(b)):
        return 1.0
    return float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    """Interquartile range: the noise figure quoted beside each median."""
    if len(xs) < 2:
        return 0.0
    q75, q25 = np.percentile(xs, [75, 25])
    return float(q75 - q25)


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    p_good: float  # vs the GOOD endpoint's samples
    p_bad: float


def classify(
    xs: Sequence[float], good: Sequence[float], bad: Sequence[float], alpha: float = ALPHA
) -> Classification:
    """GOOD, BAD or UNKNOWN for one commit's samples against the two endpoints' samples."""
    p_good, p_bad = rank_p(xs, good), rank_p(xs, bad)
    place = position(median(xs), median(good), median(bad))
    if place >= 2 / 3 and p_good < alpha:
        verdict = Verdict.BAD
    elif place <= 1 / 3 and p_bad < alpha:
        verdict = Verdict.GOOD
    else:
        verdict = Verdict.UNKNOWN
    return Classification(verdict, p_good, p_bad)


def position(x: float, good: float, bad: float) -> float:
    """Where x sits on the way from good (0) to bad (1), in ratios where all three are
    positive (else in differences); beyond the ends is < 0 or > 1."""
    if bad == good:
        return 0.5
    if min(x, good, bad) > 0:
        return math.log(x / good) / math.log(bad / good)
    return (x - good) / (bad - good)


@dataclass(frozen=True)
class Effect:
    """after - before (difference of medians) with a bootstrap confidence interval."""

    before: float  # median
    after: float
    delta: float
    low: float
    high: float
    p: float  # Mann-Whitney, before vs after

    @property
    def relative(self) -> float:
        return self.delta / self.before if self.before else float("nan")

    def describe(self, unit: str = "") -> str:
        pct = f" ({self.relative:+.1%})" if self.before else ""
        ci = f"{CONFIDENCE:.0%} CI [{self.low:+.4g}, {self.high:+.4g}]"
        return f"{self.before:.4g} -> {self.after:.4g}{unit}: {self.delta:+.4g}{pct}, {ci}"


def _median_shift(before, after, axis=-1):
    return np.median(after, axis=axis) - np.median(before, axis=axis)


def effect(before: Sequence[float], after: Sequence[float]) -> Effect:
    """The size of the change, with a percentile bootstrap interval (scipy.stats.bootstrap)."""
    delta = median(after) - median(before)
    low = high = delta
    if len(before) >= 2 and len(after) >= 2:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tiny or constant samples: degenerate is fine
            res = stats.bootstrap(
                (np.asarray(before, float), np.asarray(after, float)),
                _median_shift,
                vectorized=True,
                paired=False,
                confidence_level=CONFIDENCE,
                n_resamples=2000,
                method="percentile",
                rng=np.random.default_rng(0),  # the same samples give the same report
            )
        ci = res.confidence_interval
        if np.isfinite(ci.low) and np.isfinite(ci.high):
            low, high = float(ci.low), float(ci.high)
    return Effect(median(before), median(after), delta, low, high, rank_p(before, after))
