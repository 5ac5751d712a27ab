"""Every outcome says what the evidence supports, and the terminal, report.md, report.json and
the exit code agree on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bisect.helpers import make_project, result, step
from tests.conftest import ft_env, run_ft

pytestmark = pytest.mark.timeout(300)


def test_a_culprit_whose_confirmation_fails_is_never_found(tmp_path, monkeypatch):
    # commit 7's figure flips between the two modes: bad for the search's three samples, then
    # like its neighbour for every fresh confirmation sample
    monkeypatch.setenv("FIG_SEED", "flat")  # fixed noise: 1 run in 20 would "differ" by chance
    figures: list[float | str] = step(12, 7)
    figures[7] = "80 80 80 100"
    p = make_project(tmp_path, figures)
    rep = result(p.bisect("--max-repeats", "12"), exit_code=3)
    assert rep["outcome"] == "unconfirmed" and rep["culprit"] is None
    assert rep["suspect"]["sha"] == p.shas[7]  # what is known is still said
    assert rep["confirmation"]["confirmed"] is False
    assert "12+12 fresh interleaved samples of the two do not differ" in rep["message"]
    assert rep["message"].startswith(f"not confirmed: the search points at {p.shas[7][:10]}")
    md = (Path(rep["out"]) / "report.md").read_text()
    assert md.startswith(
        f"### `ft bisect {p.shas[0][:10]}..{p.shas[-1][:10]}`: unconfirmed (exit 3)"
    )
    assert "Suspect, **not confirmed**" in md and "first bad commit" not in md

    again = run_ft(*p.args("--max-repeats", "12"), env=ft_env(COLUMNS="80"))  # read back
    assert again.returncode == 3
    assert "first bad commit" not in again.stdout
    assert "not confirmed" in again.stdout and "outcome: unconfirmed (exit 3)" in again.stdout


def test_commits_that_stay_between_good_and_bad_are_ambiguous(tmp_path, monkeypatch):
    # two steps: 100 -> 90 at commit 5, 90 -> 80 at commit 8; 90 sits halfway (in ratios)
    # fixed noise: a commit is first judged on 3 samples, and with noise seeded by the hashes
    # (new each run) a 90's median of 3 crossed a third of the way to GOOD or BAD 1 run in ~12
    monkeypatch.setenv("FIG_SEED", "flat")
    figures = [100.0] * 5 + [90.0] * 3 + [80.0] * 4
    p = make_project(tmp_path, figures)
    rep = result(p.bisect("--max-repeats", "6"), exit_code=4)
    assert rep["outcome"] == "ambiguous" and rep["culprit"] is None
    assert [c["sha"] for c in rep["candidates"]] == p.shas[5:9]
    assert "stayed between GOOD and BAD at --max-repeats 6" in rep["message"]
    unknown = [r for r in rep["commits"] if r["verdict"] == "unknown"]
    assert unknown and all(r["n"] >= 6 for r in unknown)  # measured more before giving up


def test_the_terminal_reads_well_at_80_columns(tmp_path):
    subject = "a long subject that would wrap the table at eighty columns if it were let"
    changes = {6: {"crash-me": "x"}, 7: {"crash-me": None}}  # the first cut lands on 6
    p = make_project(tmp_path, step(12, 9), changes, subjects={9: subject})
    proc = run_ft(*p.args(), env=ft_env(COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("│")]
    assert all(len(ln) <= 80 for ln in table)
    assert len(table) == len({ln.split("│")[2].strip() for ln in table})  # a line per commit
    assert any("a long subject" in ln and ln.rstrip("│ ").endswith("…") for ln in table)
    assert "outcome: found (exit 0)" in proc.stdout
    assert "first bad commit: " + p.shas[9] in proc.stdout

    log = proc.stderr
    assert log.count("build failed: crash-me") == 1  # a skip is told once
    lefts = [int(n) for n in re.findall(r"(\d+) commits? left to test", log)]
    assert lefts == sorted(lefts, reverse=True) and len(set(lefts)) == len(lefts)
    assert "1 commit left" in log or 1 not in lefts
    assert "(worker" not in log  # one worker: nothing to tell apart
    assert "10 commits between" in log


def test_help_says_bad_is_any_bad_revision_and_lists_the_exit_codes():
    proc = run_ft("bisect", "--help", env=ft_env(COLUMNS="200"))
    text = " ".join(proc.stdout.split())
    assert "any bad one, not necessarily the first" in text
    assert "is read from their measurements" in text
    assert "0 found" in text and "3 unconfirmed" in text and "5 no change" in text
