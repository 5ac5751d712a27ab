"""The fixed set of verdicts and the one mapping between them and exit codes.

A measuring command talks to the driver through its exit code, as in `git bisect run`:
0 = it measured (the number is on its last line), 125 = skip this commit, anything else = it
failed, which is also a skip (a failed build is never evidence that a commit is good or bad).
`ft bisect` itself exits with the code of how the search ended (EXIT_CODES).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

SKIP_EXIT_CODE = 125  # git bisect run's "cannot test this commit"


class Verdict(str, Enum):
    GOOD = "good"  # like the GOOD endpoint
    BAD = "bad"  # like the BAD endpoint
    UNKNOWN = "unknown"  # samples do not tell, even at --max-repeats
    SKIP = "skip"  # could not be measured (patch, build, install, start, command failed)
    ABORT = "abort"  # the search cannot go on (too many skips, endpoints alike, interrupted)


@dataclass(frozen=True)
class Skip:
    """A commit that could not be measured, and why (shown in the report's table)."""

    reason: str


def command_outcome(returncode: int) -> Skip | None:
    """Map a measuring command's exit code: None = measured, else why the commit is skipped."""
    if returncode == 0:
        return None
    if returncode == SKIP_EXIT_CODE:
        return Skip("the command asked to skip (exit 125)")
    if returncode < 0:
        return Skip(f"the command was killed by signal {-returncode}")
    return Skip(f"the command failed (exit {returncode})")


class Outcome(str, Enum):
    """How `ft bisect` ended. `found` is the only success; each undecided outcome has its own
    exit code, so a script can tell them apart (docs/bisect.md lists them beside git bisect's)."""

    FOUND = "found"  # one commit, and fresh interleaved samples confirm the change at it
    ABORTED = "aborted"  # the search could not go on (too many skips): an `error:` line says why
    RANGE = "range"  # confirmed, but skipped commits leave several candidates
    UNCONFIRMED = "unconfirmed"  # narrowed down, but re-measuring did not show the change there
    AMBIGUOUS = "ambiguous"  # confirmed, but commits between stay between GOOD and BAD
    NO_CHANGE = "no-change"  # GOOD and BAD do not differ: there is nothing to bisect
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM; every finished sample is saved

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]


EXIT_CODES = {
    Outcome.FOUND: 0,
    Outcome.ABORTED: 1,  # also every bad-input error
    Outcome.RANGE: 2,  # git bisect run's "cannot bisect more" (only skipped commits left)
    Outcome.UNCONFIRMED: 3,
    Outcome.AMBIGUOUS: 4,
    Outcome.NO_CHANGE: 5,
    Outcome.INTERRUPTED: 130,  # 128 + SIGINT, as a shell reports it
}
