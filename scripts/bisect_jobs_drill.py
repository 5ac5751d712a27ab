"""Issue 10's drill: a planted-regression history made from this checkout, bisected in engine mode
with --jobs N and --jobs 1; prints each run's wall time, culprit and the GPU of every sample.

    python scripts/bisect_jobs_drill.py OUT_DIR --jobs 2 --device cuda
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = "        token_ids = self._run(seqs, is_prefill)\n"
SLOW = "        time.sleep(0.03)  # planted: 30 ms more per engine step\n"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def make_history(repo: Path) -> tuple[list[str], str]:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "ft", repo / "ft", ignore=skip)  # a copy of a tree need not be git's
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, repo / name)
    git(repo, "init", "-q", "-b", "main")
    shas = []
    for i in range(7):
        if i == 3:  # the culprit
            runner = repo / "ft" / "engine" / "runner.py"
            runner.write_text(runner.read_text().replace(ANCHOR, ANCHOR + SLOW, 1))
        else:
            (repo / "NOTES.md").write_text(f"note {i}\n")
        git(repo, "add", "-A")
        git(
            repo,
            "-c",
            "user.name=drill",
            "-c",
            "user.email=drill@example.invalid",
            "commit",
            "-q",
            "-m",
            f"change {i}",
        )
        shas.append(git(repo, "rev-parse", "HEAD"))
    return shas, shas[3]


def bisect(repo: Path, shas: list[str], jobs: int, device: str, out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ft",
            "bisect",
            f"{shas[0]}..{shas[-1]}",
            "--repo",
            str(repo),
            "--serve-args",
            f"--device {device}",
            "--prompts",
            "2",
            "--max-tokens",
            "16",
            "--repeats",
            "2",
            "--jobs",
            str(jobs),
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"jobs": jobs, "wall_s": wall, "error": proc.stderr[-2000:]}
    rep = json.loads(proc.stdout)
    return {"jobs": jobs, "wall_s": round(wall, 1), "culprit": rep["culprit"], "report": rep}


def _count(keys) -> dict[str, int]:
    counts: dict[str, int] = {}
    for worker, gpu in keys:
        key = f"worker {worker} gpu {gpu}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    repo = args.out / "history"
    repo.mkdir(parents=True)
    shas, planted = make_history(repo)
    for jobs in (args.jobs, 1):
        res = bisect(repo, shas, jobs, args.device, args.out / f"bisect-jobs{jobs}")
        rep = res.pop("report", None)
        if rep is not None:
            samples = [x for c in rep["commits"] for x in c.get("samples", [])]
            res["samples_by_worker_gpu"] = _count((x.get("worker"), x.get("gpu")) for x in samples)
            (args.out / f"bisect-jobs{jobs}.json").write_text(json.dumps(rep, indent=1))
        print(json.dumps({**res, "planted": planted}, default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
