"""Which judge a bisect's options name: a `--run` command, or engine mode's own `ft serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ft import settings
from ft.bisect.judge import Judge, RunCommandJudge
from ft.errors import FtError


class JudgeOptions(Protocol):
    """What make_judge reads of the bisect's options (driver.BisectOptions has them)."""

    run: str | None
    metric: str | None
    timeout_s: float
    engine: Any


def make_judge(opts: JudgeOptions, cache: Path | None = None) -> Judge:
    """The judge the options name; `cache`: where engine mode keeps its environments."""
    if opts.run:
        return RunCommandJudge(opts.run, opts.metric, opts.timeout_s)
    import importlib.util

    from ft.bisect.engine_judge import EngineJudge

    if importlib.util.find_spec("ft.bench.workload") is None:
        raise FtError("engine mode needs the workload client (ft/bench/workload.py); use --run")
    return EngineJudge(opts.engine, cache=cache or settings.cache_dir() / "bisect" / "envs")
