"""`ft demo` end to end on small settings, and its scratch history on its own."""

from __future__ import annotations

import json
import os
import py_compile
from pathlib import Path

import git
import psutil
import pytest
import torch

from ft.demo.edits import PLANTED, PLANTED_FUNCTION
from ft.demo.history import GOOD_TAG, build_history
from ft.demo.prepare import isolated_env
from tests.conftest import ft_env, run_ft

SMALL = ("--prompts", "1", "--max-tokens", "16", "--repeats", "2", "--diagnose-prompts", "4")


def _planted_in(repo: Path) -> git.Commit:
    """The planted commit, found by its subject in the scratch repository itself."""
    found = [c for c in git.Repo(repo).iter_commits() if c.summary == PLANTED.subject]
    assert len(found) == 1
    return found[0]


def _run_demo(tmp_path: Path, device: str) -> tuple[Path, dict]:
    out = tmp_path / "demo"
    cache = tmp_path / "cache"  # no profile yet: the demo's becomes the default one
    res = run_ft("demo", "--out", str(out), "--device", device, *SMALL, "--json",
                 env=ft_env(FT_CACHE_DIR=str(cache)), timeout=290)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    outcome = json.loads(res.stdout)
    assert outcome["profile_is_default"] and (cache / "benchbw.json").is_file()
    return out, outcome


def _check_the_story(out: Path, outcome: dict) -> None:
    hybrid = json.loads((out / "diagnose" / "hybrid" / "report.json").read_text())
    hot = next(f for f in hybrid["findings"] if f["id"] == "hot-thread")
    thread = next(t for t in hybrid["threads"] if t["tid"] == hot["evidence"]["tid"])
    assert thread["name"] == "ft-engine"  # the engine thread burns...
    assert any(PLANTED_FUNCTION in frame for frame in hot["evidence"]["hottest_frames"])
    pool = [t for t in hybrid["threads"] if t["role"] == "cpu-moe pool"]
    assert pool and all(t["cpu_pct"] < 5 for t in pool)  # ...while the pool sits idle
    assert any(f["id"] == "cpu-pool-idle" for f in hybrid["findings"])
    assert (out / "diagnose" / "offload" / "report.md").is_file()  # the side-by-side partner

    planted = _planted_in(out / "scratch")
    rep = json.loads((out / "bisect" / "report.json").read_text())
    assert rep["culprit"]["sha"] == planted.hexsha == outcome["culprit"]
    assert rep["culprit"]["subject"] == PLANTED.subject
    summary = (out / "summary.md").read_text()
    assert planted.hexsha[:10] in summary and PLANTED_FUNCTION in summary
    assert str(out / "bisect" / "report.md") in summary

    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(
        p.info["cmdline"] or [])]  # fmt: skip
    assert leftovers == []  # no server outlives the demo
    assert git.Repo(out / "scratch").git.worktree("list").count("\n") == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_diagnoses_the_inline_frames_and_bisects_to_the_planted_commit(tmp_path):
    _check_the_story(*_run_demo(tmp_path, "cpu"))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_demo_on_cuda_tells_the_same_story(tmp_path):
    out, outcome = _run_demo(tmp_path, "cuda")
    print(f"demo on cuda: {outcome['seconds']}, hybrid {outcome['hybrid_tok_s']} tok/s, "
          f"offload {outcome['offload_tok_s']}")  # fmt: skip
    _check_the_story(out, outcome)
    assert outcome["offload_over_hybrid"] >= 2.0  # the seed's shape: hybrid far slower


def test_the_scratch_history_plants_one_inline_regression_after_the_tag(tmp_path):
    with isolated_env(tmp_path / "out", _profile(tmp_path)):
        history = build_history(tmp_path / "scratch")
    repo = git.Repo(history.repo)
    commits = list(repo.iter_commits(f"{GOOD_TAG}..HEAD"))
    assert len(commits) == history.commits >= 5
    assert repo.commit(GOOD_TAG).hexsha == history.good_sha
    assert history.planted_sha == _planted_in(history.repo).hexsha
    index = [c.hexsha for c in reversed(commits)].index(history.planted_sha)
    assert 0 < index < len(commits) - 1  # ordinary commits on both sides of it
    diff = repo.git.show(history.planted_sha, "--format=")
    assert f"+    def {PLANTED_FUNCTION}(" in diff
    assert "-        return self.pool.submit_routed(" in diff
    touched = {f for c in commits if c.hexsha != history.planted_sha for f in c.stats.files}
    assert touched and "ft/engine/cpu/pool.py" in touched  # red herrings exist
    for path in ("ft/engine/strategies/hybrid.py", "ft/engine/cpu/pool.py", "ft/bench/bw.py"):
        py_compile.compile(str(history.repo / path), doraise=True)
    assert not repo.is_dirty(untracked_files=True)


def test_isolated_env_hides_the_users_git_and_fault_switches_then_restores_them(tmp_path):
    before = dict(os.environ)
    os.environ["GIT_DIR"] = "/somewhere/else/.git"
    os.environ["FT_CPU_MOE_INLINE"] = "1"
    try:
        with isolated_env(tmp_path / "out", _profile(tmp_path)) as cache:
            assert "GIT_DIR" not in os.environ and "FT_CPU_MOE_INLINE" not in os.environ
            assert os.environ["FT_CACHE_DIR"] == str(cache)
            assert (cache / "benchbw.json").read_text() == "{}"
        assert os.environ["GIT_DIR"] == "/somewhere/else/.git"
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_a_used_out_dir_or_unknown_device_is_one_error_line(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    res = run_ft("demo", "--out", str(tmp_path / "used"), "--device", "cpu")
    assert res.returncode == 1 and res.stderr.startswith("error: --out")
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"
    res = run_ft("demo", "--out", str(tmp_path / "new"), "--device", "tpu")
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [
        "error: --device must be cpu or cuda, not 'tpu'"
    ]
    if not torch.cuda.is_available():
        res = run_ft("demo", "--out", str(tmp_path / "new"), "--device", "cuda")
        assert res.returncode == 1 and res.stderr.startswith("error: --device cuda: torch sees no")
    assert not (tmp_path / "new").exists()


def _profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text("{}")
    return path
