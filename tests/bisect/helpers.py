"""Repositories built by the tests: one small file per commit holds the figure a tiny script
prints (plus seeded noise), so every test knows where the step is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import run_ft

MEASURE = r"""
import os, pathlib, random, sys
counter = pathlib.Path(sys.argv[1])
commit = os.environ.get("FT_BISECT_COMMIT", "?")
with counter.open("a") as f:
    f.write(commit + "\n")
n = len(counter.read_text().splitlines())
wt = pathlib.Path.cwd()
if (wt / "skip-me").exists():
    sys.exit(125)
if (wt / "crash-me").exists():
    print("build failed: crash-me", file=sys.stderr)
    sys.exit(2)
if "v2" not in (wt / "loader.txt").read_text():
    print("cannot load the checkpoint", file=sys.stderr)
    sys.exit(1)
# figure.txt: one figure, or a sequence for this commit's 1st, 2nd, ... sample (the last repeats)
figures = [float(x) for x in (wt / "figure.txt").read_text().split()]
earlier = counter.read_text().splitlines()[:-1].count(commit)
value = figures[min(earlier, len(figures) - 1)]
print("warming up")
seed = os.environ.get("FIG_SEED") or commit  # FIG_SEED: the same noise whatever the hashes
print(value * (1 + random.Random(f"{seed}-{n}").gauss(0, 0.02)))
"""

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Ada Tester",
    "GIT_AUTHOR_EMAIL": "ada@example.com",
    "GIT_COMMITTER_NAME": "Ada Tester",
    "GIT_COMMITTER_EMAIL": "ada@example.com",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@dataclass
class Project:
    repo: Path
    shas: list[str]  # oldest first: shas[0] is GOOD
    script: Path  # the measuring script, outside the repo
    counter: Path  # one line per measurement run

    def runs(self) -> list[str]:
        return self.counter.read_text().split() if self.counter.exists() else []

    @property
    def cmd(self) -> str:
        return f"{sys.executable} {self.script} {self.counter}"

    def args(self, *extra: str, good: int = 0, bad: int = -1, out: str = "out") -> list[str]:
        """`ft bisect` over the project, its report in OUT (for the terminal: no --json)."""
        rng = f"{self.shas[good]}..{self.shas[bad]}"
        return ["bisect", rng, "--repo", str(self.repo), "--run", self.cmd,
                "--out", str(self.repo.parent / out), *extra]  # fmt: skip

    def bisect(self, *args: str, good: int = 0, bad: int = -1, out: str = "out"):
        return run_ft(*self.args("--json", *args, good=good, bad=bad, out=out), timeout=240)


def make_project(
    tmp: Path,
    figures: list[float | str],
    changes: dict[int, dict[str, str | None]] | None = None,
    loader: str = "format v2\n",
    subjects: dict[int, str] | None = None,
) -> Project:
    """Commit i sets figure.txt to figures[i] and applies changes[i] (None deletes a file);
    subjects[i] replaces its commit subject."""
    repo = tmp / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "loader.txt").write_text(loader)
    shas = []
    for i, fig in enumerate(figures):
        (repo / "figure.txt").write_text(f"{fig}\n")
        for name, text in (changes or {}).get(i, {}).items():
            if text is None:
                (repo / name).unlink()
            else:
                (repo / name).parent.mkdir(parents=True, exist_ok=True)
                (repo / name).write_text(text)
        git(repo, "add", "-A")
        subject = (subjects or {}).get(i, f"change {i}: figure {fig}")
        git(repo, "commit", "-q", "--allow-empty", "-m", subject)
        shas.append(git(repo, "rev-parse", "HEAD"))
    script = tmp / "measure.py"
    script.write_text(MEASURE)
    return Project(repo, shas, script, tmp / "runs.txt")


def step(n: int, at: int, before: float = 100.0, after: float = 80.0) -> list[float]:
    """n figures, `before` up to commit at-1, `after` from commit `at` on."""
    return [before if i < at else after for i in range(n)]


def result(proc, exit_code: int = 0) -> dict:
    """The --json report of a run that exited with `exit_code`, which the report repeats."""
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["exit_code"] == exit_code
    return rep


def culprit(rep: dict) -> str:
    """The first bad commit of a report, which must have found one (else show the table)."""
    table = [
        (
            r["index"],
            r["verdict"],
            r["reason"],
            r["n"],
            [round(x["value"], 1) for x in r["samples"]],
        )
        for r in rep["commits"]
    ]
    assert rep["outcome"] == "found", (rep["message"], table)
    return rep["culprit"]["sha"]
