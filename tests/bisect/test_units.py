"""The pieces without git: verdicts, figures, statistics, cuts."""

from __future__ import annotations

import random

import pytest

from ft.bisect.config import BisectConfig
from ft.bisect.judge import parse_figure
from ft.bisect.search import cut_points
from ft.bisect.stats import classify, effect, rank_p
from ft.bisect.verdict import Outcome, Skip, Verdict, command_outcome
from ft.errors import FtError

GOOD = [100.1, 98.0, 99.6, 101.5, 98.6, 97.1]
BAD = [80.8, 80.4, 80.1, 76.7, 77.4, 82.2]


def test_exit_codes_map_once():
    assert command_outcome(0) is None
    assert "exit 125" in command_outcome(125).reason
    assert "failed (exit 1)" in command_outcome(1).reason
    assert "signal 9" in command_outcome(-9).reason
    assert Outcome.FOUND.exit_code == 0 and Outcome.ABORTED.exit_code == 1
    codes = [o.exit_code for o in Outcome]
    assert len(set(codes)) == len(codes)  # a script tells every outcome apart
    assert [o for o in Outcome if o.exit_code == 0] == [Outcome.FOUND]
    assert Outcome.RANGE.exit_code == 2  # git bisect run's "cannot bisect more"


def test_the_axis_names_the_figure_and_which_way_is_worse():
    from ft.bisect.report import axis_label

    def rep(measure, direction="lower"):
        return {"measure": measure, "direction": direction}

    assert (
        axis_label(rep({"judge": "run", "command": "python b.py", "metric": "decode.tok_s"}))
        == "decode.tok_s (lower is worse)"
    )
    assert (
        axis_label(rep({"judge": "run", "command": "python b.py", "metric": None}, "higher"))
        == "python b.py (higher is worse)"
    )
    engine = {"judge": "engine", "figure": "e2e_decode_tok_s"}
    assert axis_label(rep(engine)) == "e2e_decode_tok_s (lower is worse)"
    long = axis_label(rep({"judge": "run", "command": "x" * 80, "metric": None}))
    assert len(long) < 70 and "figure" not in long


def test_jobs_beyond_the_box_warn(monkeypatch):
    from ft.bisect import config

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(config, "allowed_cores", lambda: [0, 1])
    assert config.interference(1, engine=False) is None
    warning = config.interference(2, engine=False)
    assert "2 measurements at once on 2 cores" in warning and "--jobs 1" in warning
    monkeypatch.setattr(config, "allowed_cores", lambda: list(range(16)))
    assert config.interference(4, engine=False) is None
    monkeypatch.setattr(config, "_nvml_gpu_count", lambda: 2)
    assert config.interference(2, engine=True) is None
    assert "on 2 GPUs" in config.interference(3, engine=True)
    monkeypatch.setattr(config, "_nvml_gpu_count", lambda: 0)
    assert "no GPU" in config.interference(2, engine=True)


def test_plurals():
    from ft.report import plural

    assert plural(1, "commit") == "1 commit" and plural(2, "commit") == "2 commits"
    assert plural(0, "thread") == "0 threads" and plural(3, "index", "indices") == "3 indices"


@pytest.mark.parametrize(
    ("stdout", "metric", "expected"),
    [
        ("compiling\n12.5\n", None, 12.5),
        ('{"decode": {"tok_s": 33.4}}\n', "decode.tok_s", 33.4),
        ('log\n{"tok_s": 7}', "tok_s", 7.0),
    ],
)
def test_figures_are_read_from_the_last_line(stdout, metric, expected):
    assert parse_figure(stdout, metric) == expected


@pytest.mark.parametrize(
    ("stdout", "metric", "reason"),
    [
        ("", None, "printed nothing"),
        ("12.5\ndone\n", None, "not a number: 'done'"),
        ('{"other": 1}', "tok_s", "no 'tok_s'"),
        ("nan", None, "figure is nan"),
    ],
)
def test_unreadable_figures_are_skips_with_the_reason(stdout, metric, reason):
    skip = parse_figure(stdout, metric)
    assert isinstance(skip, Skip) and reason in skip.reason


def test_a_good_commit_stays_good_however_many_samples_it_gets():
    # seen in CI: 24 samples of a good commit differ a little from 6 of the endpoint
    rng = random.Random(1)
    xs = [101 + rng.gauss(0, 1.5) for _ in range(24)]
    assert rank_p(xs, GOOD) < 0.05
    assert classify(xs, GOOD, BAD).verdict == Verdict.GOOD


def test_a_slow_run_of_a_good_commit_is_good_on_a_large_regression():
    # seen in CI (2-core box): endpoints 145 vs 17 tok/s, a good commit's server at ~98 tok/s;
    # a third of the way on a straight line (unknown), a fifth of the way in ratios
    good = [150.2, 144.7, 139.8, 146.1, 141.0, 148.3]
    bad = [16.8, 17.5, 16.1, 15.9, 17.2, 16.5]
    slow = [112.4, 108.2, 109.9, 107.4, 79.4, 89.5, 71.1, 99.1, 91.4, 114.5, 97.4, 100.6]
    assert classify(slow, good, bad).verdict == Verdict.GOOD
    assert classify([40.1, 38.7, 41.9, 39.5], good, bad).verdict == Verdict.UNKNOWN  # halfway
    assert classify([24.0, 22.9, 25.3, 23.8], good, bad).verdict == Verdict.BAD


def test_verdicts_against_both_endpoints():
    assert classify([99.0, 100.5, 98.2], GOOD, BAD).verdict == Verdict.GOOD
    assert classify([79.0, 81.5, 80.2], GOOD, BAD).verdict == Verdict.BAD
    assert classify([99.0, 80.5], GOOD, BAD).verdict == Verdict.UNKNOWN  # too few to tell
    assert classify([90.0, 90.5, 89.8, 90.2], GOOD, BAD).verdict == Verdict.UNKNOWN  # halfway


def test_effect_has_a_confidence_interval_around_the_shift():
    eff = effect(GOOD, BAD)
    assert eff.low <= eff.delta <= eff.high < 0
    assert -0.25 < eff.relative < -0.15
    assert eff.p < 0.01


def test_cuts_split_the_range_evenly():
    assert cut_points(list(range(1, 15)), 1) == [8]
    three = cut_points(list(range(1, 16)), 3)
    assert len(three) == 3 and three == sorted(three)
    gaps = [b - a for a, b in zip([0, *three], [*three, 16], strict=True)]
    assert max(gaps) - min(gaps) <= 1
    assert cut_points([4, 5], 3) == [4, 5]


def test_bad_settings_are_user_errors():
    with pytest.raises(FtError, match="--max-repeats"):
        BisectConfig(repeats=8, max_repeats=4)


def test_workers_share_the_gpus_there_are(monkeypatch):
    from ft.bisect import config

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(config, "_nvml_gpu_count", lambda: 1)
    assert config.worker_gpus(3, engine=True) == ["0"]  # one GPU: every worker on it
    monkeypatch.setattr(config, "_nvml_gpu_count", lambda: 0)
    assert config.worker_gpus(2, engine=True) == ["0", "1"]  # no NVML: one per worker
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert config.worker_gpus(4, engine=True) == ["2", "3"]
    assert config.worker_gpus(1, engine=False) is None


def test_a_commit_runs_its_own_source_and_keeps_the_path_behind_it(tmp_path):
    import os

    from ft.bisect.engine_judge import commit_env

    env = commit_env(tmp_path, {"PYTHONPATH": "/deps/site"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/deps/site"]
    assert commit_env(tmp_path, {})["PYTHONPATH"] == str(tmp_path)


def test_worker_worktrees_made_at_once_from_threads_all_check_out(tmp_path):
    """--jobs N makes one worktree a worker: made from N threads at once, each must come whole
    (a `prune` racing another slot's `add` deleted that worktree's admin folder)."""
    from concurrent.futures import ThreadPoolExecutor

    from ft.bisect.gitrepo import Scratch, UserRepo
    from tests.bisect.helpers import git

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "f.txt").write_text("1\n")
    git(repo, "add", "f.txt")
    git(repo, "commit", "-q", "-m", "one")
    base = git(repo, "rev-parse", "HEAD")
    for attempt in range(3):
        scratch = Scratch(UserRepo(repo), tmp_path / f"scratch{attempt}", base)
        with ThreadPoolExecutor(6) as pool:
            paths = list(pool.map(scratch.worktree, range(6)))
        assert [(p / "f.txt").read_text() for p in paths] == ["1\n"] * 6
