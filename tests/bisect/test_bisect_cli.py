"""`ft bisect --run` end to end on repositories built here, counting every measurement."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bisect.helpers import culprit, git, make_project, result, step
from tests.conftest import ft_env

pytestmark = pytest.mark.timeout(300)


def test_noisy_step_is_found_in_bounded_measurements(tmp_path):
    p = make_project(tmp_path, step(16, 11))
    rep = result(p.bisect())
    assert rep["outcome"] == "found"
    assert culprit(rep) == p.shas[11]
    assert rep["culprit"]["author"].startswith("Ada Tester")
    assert "figure.txt" in rep["culprit"]["diffstat"]
    assert rep["confirmation"]["confirmed"], rep["confirmation"]
    assert rep["direction"] == "lower"
    assert -0.3 < rep["confirmation"]["effect"]["relative"] < -0.1  # the planted -20%
    # endpoints 2x6, at most 5 cuts of up to 6 samples, confirmation 2x6: far below 16 x 3
    assert len(p.runs()) <= 12 + 5 * 6 + 12
    assert len(p.runs()) == rep["samples_taken"]
    out = Path(rep["out"])
    assert (out / "plot.png").stat().st_size > 1000
    assert p.shas[11][:10] in (out / "report.md").read_text()
    for row in rep["commits"]:  # raw samples kept with their metadata; n counts them all
        confirm = [s for s in row["samples"] if s["phase"] == "confirm"]
        assert len(row["samples"]) == row["n"] >= 3 and row["n_confirm"] == len(confirm)
    rows = {r["index"]: r for r in rep["commits"]}
    assert rows[11]["n_confirm"] >= 6 and rows[11]["n"] > rows[11]["n_confirm"]


def test_failing_commits_are_skipped_and_the_culprit_still_found(tmp_path):
    # the first cuts land on 8 then 7: both fail, in the two ways a command can
    changes = {7: {"skip-me": "x"}, 8: {"skip-me": None, "crash-me": "x"}, 9: {"crash-me": None}}
    p = make_project(tmp_path, step(16, 12), changes)
    rep = result(p.bisect())
    assert culprit(rep) == p.shas[12]
    reasons = {r["index"]: r["reason"] for r in rep["commits"] if r["verdict"] == "skip"}
    assert reasons, "the planted failures were never hit"
    for i, reason in reasons.items():
        assert i in (7, 8)
        assert "exit 125" in reason or "failed (exit 2): build failed" in reason


def test_a_culprit_next_to_a_skipped_commit_is_a_range(tmp_path):
    p = make_project(tmp_path, step(14, 8), {7: {"crash-me": "x"}, 8: {"crash-me": None}})
    rep = result(p.bisect(), exit_code=2)  # git bisect run's "cannot bisect more"
    assert rep["outcome"] == "range"
    table = [(r["index"], r["verdict"], r["median"], r["n"]) for r in rep["commits"]]
    assert [c["sha"] for c in rep["candidates"]] == p.shas[7:9], table
    assert rep["culprit"] is None


def test_too_many_skips_stop_with_a_clear_error(tmp_path):
    p = make_project(tmp_path, step(10, 6), {3: {"crash-me": "x"}, 7: {"crash-me": None}})
    proc = p.bisect("--max-skips", "0")
    assert proc.returncode == 1
    assert "too many commits could not be measured" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_fix_from_outside_the_range_is_picked_where_missing(tmp_path):
    # every commit needs the loader fix; commit 9 got the same fix as a backport
    p = make_project(tmp_path, step(14, 6), {9: {"loader.txt": "format v2\n"}}, loader="v1\n")
    git(p.repo, "checkout", "-q", "-b", "fix", p.shas[0])
    (p.repo / "loader.txt").write_text("format v2\n")
    git(p.repo, "commit", "-qam", "loader: read the new checkpoint format")
    git(p.repo, "checkout", "-q", "main")

    without = p.bisect(out="no-pick")
    assert without.returncode == 1
    assert "could not be measured" in without.stderr
    assert "cannot load the checkpoint" in without.stderr
    assert len(error_lines(without)) == 1

    rep = result(p.bisect("--pick", "fix", out="pick"))
    assert culprit(rep) == p.shas[6]
    applied = {r["index"]: r["applied"] for r in rep["commits"]}
    assert applied[0] == [f"pick {rep['settings']['picks'][0][:10]} applied"]
    assert "already in the tree" in applied[13][0]

    fix = tmp_path / "fix.patch"  # the same fix as a patch file
    fix.write_text(git(p.repo, "format-patch", "-1", "--stdout", "fix") + "\n")
    rep = result(p.bisect("--patch", str(fix), out="patch"))
    assert culprit(rep) == p.shas[6]
    applied = {r["index"]: r["applied"] for r in rep["commits"]}
    assert applied[0] == ["patch 00-fix.patch applied"]
    assert applied[13] == ["patch 00-fix.patch already in the tree"]


def test_a_patch_that_does_not_apply_skips_the_commit_with_the_reason(tmp_path):
    # notes.txt is "a" everywhere but at commit 6 (the first cut), where the patch cannot apply
    changes = {0: {"notes.txt": "a\n"}, 6: {"notes.txt": "b\n"}, 7: {"notes.txt": "a\n"}}
    p = make_project(tmp_path, step(12, 4), changes)
    patch = tmp_path / "notes.patch"
    patch.write_text("--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-a\n+c\n")
    rep = result(p.bisect("--patch", str(patch)))
    assert culprit(rep) == p.shas[4]
    rows = {r["index"]: r for r in rep["commits"]}
    assert rows[6]["verdict"] == "skip"
    assert rows[6]["reason"].startswith("--patch 00-notes.patch does not apply")
    assert rows[0]["applied"] == ["patch 00-notes.patch applied"]


def test_endpoints_that_do_not_differ_are_no_change_with_both_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("FIG_SEED", "flat")  # fixed noise: 1 run in 20 would "differ" by chance
    p = make_project(tmp_path, [100.0] * 6)
    rep = result(p.bisect("--max-repeats", "6"), exit_code=5)
    assert rep["outcome"] == "no-change" and rep["culprit"] is None
    assert "do not differ significantly" in rep["message"]
    assert rep["message"].count("[") == 2  # both samples shown
    assert len(p.runs()) == 12
    md = (Path(rep["out"]) / "report.md").read_text()
    assert md.startswith(f"### `ft bisect {p.shas[0][:10]}..{p.shas[-1][:10]}`: no-change (exit 5)")


def error_lines(proc) -> list[str]:
    """The `error:` lines (progress lines come before them on stderr)."""
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def _checkout_state(repo: Path) -> tuple[str, ...]:
    files = tuple(sorted((f.name, f.read_bytes().hex()) for f in repo.iterdir() if f.is_file()))
    return (
        git(repo, "rev-parse", "HEAD"),
        git(repo, "status", "--porcelain"),
        git(repo, "diff", "--cached"),
        git(repo, "worktree", "list"),
        git(repo, "branch", "-a"),
        str(files),
        (repo / ".git" / "BISECT_LOG").read_text(),
    )


def test_bad_input_gives_one_line_errors_and_leaves_the_checkout_alone(tmp_path):
    p = make_project(tmp_path, step(8, 4))
    git(p.repo, "bisect", "start")  # the user's own bisect must survive ours
    (p.repo / "figure.txt").write_text("55\n")  # a dirty tracked file ...
    (p.repo / "notes.txt").write_text("mine\n")  # ... and an untracked one
    git(p.repo, "add", "notes.txt")
    before = _checkout_state(p.repo)
    good, bad = p.shas[0], p.shas[-1]
    cases = {
        "RANGE must be GOOD..BAD": [good],
        "unknown revision 'nope'": [f"{good}..nope"],
        "is not an ancestor of BAD": [f"{bad}..{good}"],
        "are the same commit": [f"{good}..{good}"],
        "uncommitted changes": [f"{good}..main"],  # BAD is the dirty HEAD
    }
    for expected, args in cases.items():
        proc = subprocess.run(
            [sys.executable, "-m", "ft", "bisect", *args, "--repo", str(p.repo), "--run", "true"],
            capture_output=True, text=True, env=ft_env(), timeout=60,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and expected in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    # a range that does not end at the dirty HEAD is fine, and still touches nothing
    rep = result(p.bisect(bad=-2))
    assert culprit(rep) == p.shas[4]
    assert _checkout_state(p.repo) == before


def test_jobs_3_finds_the_same_culprit_as_jobs_1(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = make_project(tmp_path, step(14, 9))
    one = result(p.bisect(out="j1"))
    three = result(p.bisect("--jobs", "3", out="j3"))
    assert culprit(one) == culprit(three) == p.shas[9]
    samples = [s for r in three["commits"] for s in r["samples"]]
    workers = {s["worker"] for s in samples}
    assert workers == {0, 1, 2}
    assert all(s["gpu"] == str(s["worker"]) for s in samples)  # CUDA_VISIBLE_DEVICES=worker


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_runs(p, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while len(p.runs()) < n:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_an_interrupted_run_resumes_without_measuring_again(tmp_path):
    p = make_project(tmp_path, step(18, 11))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ft", "bisect", f"{p.shas[0]}..{p.shas[-1]}"]
    args += ["--repo", str(p.repo), "--run", p.cmd, "--out", str(out), "--json"]

    def start():  # SIGINT as at a terminal, even where pytest runs as a background job
        return subprocess.Popen(args, env=ft_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=_default_sigint)  # fmt: skip

    first = start()
    _wait_for_runs(p, 8, first)
    first.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130 and "interrupted" in err
    second = start()
    _wait_for_runs(p, len(p.runs()) + 10, second)
    os.kill(second.pid, signal.SIGKILL)  # kill -9
    second.communicate(timeout=60)

    resume = [sys.executable, "-m", "ft", "bisect", "--resume", "--json"]
    resumed = result(subprocess.run(resume, capture_output=True, text=True, env=ft_env()))
    assert culprit(resumed) == p.shas[11]
    stored = sum(len(json.loads(f.read_text())["samples"]) for f in (out / "samples").iterdir())
    assert len(p.runs()) - stored <= 2  # only the sample in flight at each interruption
    again = len(p.runs())
    rep = result(p.bisect())  # a repeated identical run measures nothing
    assert len(p.runs()) == again and rep["samples_taken"] == 0
    assert culprit(rep) == p.shas[11]


def test_ray_without_ray_installed_is_one_error_line(tmp_path, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from ft.cli.app import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))  # fmt: skip
    p = make_project(tmp_path, step(4, 2))
    res = CliRunner().invoke(app, [*p.args("--ray", "local")])
    assert res.exit_code == 1
    assert res.output.strip() == "error: --ray needs Ray: pip install 'freetoken[ray]'"
    assert not (tmp_path / "out").exists()  # nothing written before the input is valid
