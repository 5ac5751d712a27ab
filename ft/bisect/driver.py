"""One `ft bisect` run: check the input (nothing written before it is valid), set up the
scratch clone, patch stack, store and judge, search, write the report."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft import settings
from ft.bisect.config import BisectConfig, interference, worker_gpus
from ft.bisect.gitrepo import PatchStack, Scratch, UserRepo
from ft.bisect.judge import Judge
from ft.bisect.judges import make_judge
from ft.bisect.store import SampleStore
from ft.bisect.verdict import Outcome
from ft.errors import FtError
from ft.report import plural, write_json_atomic

RUN_FILE = "run.json"  # the options of the run in an out dir, for --resume


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = None
    serve_args: str = ""  # engine flags for `ft serve`, e.g. "--moe-strategy hybrid"
    prompts: int = 8
    max_tokens: int = 64
    concurrency: int = 1
    figure: str = "e2e_decode_tok_s"
    install_timeout_s: float = 900.0
    start_timeout_s: float = 600.0
    workload_timeout_s: float = 600.0


@dataclass(frozen=True)
class BisectOptions:
    range: str
    repo: str = "."
    run: str | None = None
    metric: str | None = None
    picks: tuple[str, ...] = ()
    patches: tuple[str, ...] = ()
    timeout_s: float = 600.0
    search: BisectConfig = BisectConfig()
    engine: EngineOptions = EngineOptions()
    out: str | None = None
    ray: str | None = None  # a Ray address (`local`, `auto`, `ray://host:10001`, `host:6379`)
    cpus_per_job: float = 1.0  # --run under --ray: the CPUs one measurement holds

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BisectOptions:
        d = dict(d, search=BisectConfig(**d["search"]), engine=EngineOptions(**d["engine"]))
        return cls(**{**d, "picks": tuple(d["picks"]), "patches": tuple(d["patches"])})


def split_range(text: str) -> tuple[str, str]:
    good, sep, bad = text.partition("..")
    if not sep or not good or not bad or bad.startswith("."):
        raise FtError(f"RANGE must be GOOD..BAD (two revisions), not {text!r}")
    return good, bad


def resume_options(out: str | None) -> BisectOptions:
    """--resume without a range: the options saved by the run in OUT (default: the last run)."""
    last = settings.cache_dir() / "bisect" / "last-run"
    out_dir = Path(out) if out else Path(last.read_text().strip()) if last.exists() else None
    if out_dir is None or not (out_dir / RUN_FILE).exists():
        raise FtError("nothing to resume: no earlier run found (give --out DIR of that run)")
    return BisectOptions.from_json(json.loads((out_dir / RUN_FILE).read_text()))


def bisect(
    opts: BisectOptions, log: Callable[[str], None], judge: Judge | None = None
) -> dict[str, Any]:
    """Run the whole bisect; `judge` replaces the one the options name (tests, other judges)."""
    user = UserRepo(Path(opts.repo))
    good_rev, bad_rev = split_range(opts.range)
    good, bad = user.resolve(good_rev), user.resolve(bad_rev)
    commits = user.commits(good, bad)
    user.refuse_dirty_endpoint(good, bad)
    picks = tuple(user.resolve(p) for p in opts.picks)
    patch_files = [Path(p).expanduser().resolve() for p in opts.patches]
    if missing := [str(p) for p in patch_files if not p.is_file()]:
        raise FtError(f"--patch file not found: {missing[0]}")
    if opts.ray:
        from ft.bisect.cluster import require_ray

        require_ray()
        if opts.cpus_per_job <= 0:
            raise FtError("--cpus-per-job must be above 0")
    judge = judge or make_judge(opts)
    out = Path(opts.out) if opts.out else default_out(user, good, bad)
    _save_run(opts, out)
    stack = PatchStack(picks, tuple(_copy_patches(patch_files, out)))
    store = SampleStore(out, stack, judge.config())
    gpus = worker_gpus(opts.search.jobs, engine=opts.run is None)
    from ft.bisect import report  # scipy and matplotlib: only once the input is valid
    from ft.bisect.search import Bisector

    between = plural(len(commits) - 2, "commit")
    log(f"{between} between {good[:10]} and {bad[:10]}; state in {out}")
    scratch = Scratch(user, out, good)
    workers, measurer = None, None
    if opts.ray:
        from ft.bisect.cluster import RayWorkers
        from ft.bisect.ray_measure import RayMeasurer

        log(f"connecting to Ray at {opts.ray}")
        workers = RayWorkers(opts.ray, opts, scratch, stack, [good, bad, *picks], log)
        measurer = RayMeasurer(workers, judge, store, log, opts.search.jobs)
        log(cluster_line(workers.describe()))
        gpus = None
    elif warning := interference(opts.search.jobs, engine=opts.run is None):
        log(f"warning: {warning}")
    bisector = Bisector(
        commits, scratch, stack, judge, store, opts.search, log, gpus, measurer=measurer
    )
    try:
        result = bisector.run()
        cluster = workers.describe() if workers else None
    finally:
        if workers:
            workers.shutdown()
    settings_json = {**dataclasses.asdict(opts.search), "picks": list(picks), "gpus": gpus}
    rep = report.build(result, user, store, settings_json, cluster)
    rep["out"] = str(out)
    report.write(rep, out)
    if result.outcome == Outcome.ABORTED:
        raise FtError(f"{result.message} (report: {out / 'report.md'})")
    return rep


def cluster_line(cluster: dict[str, Any]) -> str:
    """The cluster in one line: Ray's version, its nodes and GPUs, where the workers are."""
    alive = [n for n in cluster["nodes"] if n["alive"]]
    where = ", ".join(f"{w}@{k}" for w, k in cluster["workers"].items())
    return (
        f"Ray {cluster['ray']} at {cluster['address']}: {plural(len(alive), 'node')}, "
        f"{plural(int(cluster['gpus']), 'GPU')}; workers {where} ({cluster['per_job']} each)"
    )


def default_out(user: UserRepo, good: str, bad: str) -> Path:
    """Outside the user's checkout (so it never becomes dirty), the same for a repeated run."""
    tag = hashlib.sha256(str(user.path.resolve()).encode()).hexdigest()[:8]
    return settings.cache_dir() / "bisect" / f"{user.path.name}-{tag}-{good[:10]}-{bad[:10]}"


def _save_run(opts: BisectOptions, out: Path) -> None:
    write_json_atomic(out / RUN_FILE, opts.to_json())
    last = settings.cache_dir() / "bisect" / "last-run"
    last.parent.mkdir(parents=True, exist_ok=True)
    last.write_text(str(out.resolve()) + "\n")


def _copy_patches(files: list[Path], out: Path) -> list[Path]:
    copies = []
    for k, src in enumerate(files):
        dst = out / "patches" / f"{k:02d}-{src.name}"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        copies.append(dst)
    return copies
