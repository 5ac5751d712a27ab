"""The fixed set of verdicts and the one mapping between them and exit codes.

A measuring command talks to the driver through its exit code, as in `git bisect run`:
0 = it measured (the number is on its last line), 125 = skip this commit, anything else = it
failed, which is also a skip (a failed build is never evidence that a commit is good or bad).
`ft bisect` itself exits with the code of how the search ended.
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
    """How `ft bisect` ended; the value of `exit_code` is what the process exits with."""

    FOUND = "found"  # one commit, confirmed or not (the report says which)
    RANGE = "range"  # the culprit is one of a few commits next to skipped ones
    ABORTED = "aborted"  # too many skips, endpoints alike: an `error:` line says why
    INTERRUPTED = "interrupted"

    @property
    def exit_code(self) -> int:
        return {"found": 0, "range": 0, "aborted": 1, "interrupted": 130}[self.value]
