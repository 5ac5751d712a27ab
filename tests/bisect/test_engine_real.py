"""Engine mode for real: this project's own source, a planted slowdown commit, `ft serve` per
commit, the workload client through the API (CPU, the built-in tiny model). Kept to three
commits and two workers (the confirmation keeps both servers up): each `ft serve` start
costs a torch import."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.bisect.helpers import culprit, git, result
from tests.conftest import REPO_ROOT, run_ft

SLOW = "        time.sleep(0.02)  # planted: 20 ms more per engine step\n"
ANCHOR = "        token_ids = self._run(seqs, is_prefill)\n"


def _copy_project(dst):
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("needs this project as a git checkout")
    for name in files.stdout.splitlines():
        src = REPO_ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst / name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_engine_mode_finds_a_planted_slowdown_in_this_project(tmp_path):
    from ft.engine.synth.checkpoint import builtin_tiny

    model = builtin_tiny()  # made once here, not by two servers racing
    repo = tmp_path / "ft-src"
    _copy_project(repo)
    git(repo, "init", "-q", "-b", "main")
    shas = []

    def commit(message: str) -> None:
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty", "-m", message)
        shas.append(git(repo, "rev-parse", "HEAD"))

    commit("base")
    runner = repo / "ft" / "engine" / "runner.py"
    assert ANCHOR in runner.read_text()
    runner.write_text(runner.read_text().replace(ANCHOR, ANCHOR + SLOW, 1))
    commit("runner: tidy the step loop")
    commit("docs: another note")

    proc = run_ft(
        "bisect", f"{shas[0]}..{shas[-1]}", "--repo", str(repo), "--model", str(model),
        "--serve-args", "--device cpu", "--prompts", "2", "--max-tokens", "8",
        "--repeats", "2", "--max-repeats", "16", "--jobs", "2", "--json",
        "--out", str(tmp_path / "out"), timeout=380,
    )  # fmt: skip
    rep = result(proc)
    assert culprit(rep) == shas[1]
    assert "runner.py" in rep["culprit"]["diffstat"]
    assert rep["direction"] == "lower"  # decode tok/s fell
    assert rep["confirmation"]["confirmed"], rep["confirmation"]
