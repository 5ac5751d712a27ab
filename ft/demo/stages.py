"""The demo's measuring stages: `ft diagnose --strategy hybrid --vs offload` on the regressed
commit's source, then `ft bisect` in engine mode over the scratch history."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft.demo.config import DemoConfig
from ft.demo.history import GOOD_TAG, ScratchHistory
from ft.diagnose.server_target import ServerTarget, WorkloadSpec

Say = Callable[[str], None]
STRATEGIES = ("hybrid", "offload")  # the seed's pair: the regressed one first


class SourceServer(ServerTarget):
    """`python -m ft serve` from a source tree (not the installed ft): the tree first on
    PYTHONPATH (after the stack agent's folder) and as the working directory, where `-m`
    looks first."""

    def __init__(self, source: Path, *args: Any, **kwargs: Any):
        super().__init__(*args, command=[sys.executable, "-m", "ft", "serve"], **kwargs)
        self.source = source

    def start(self, env: dict[str, str]) -> int:
        from ft.probes.stacks import AGENT_DIR

        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        agent = [p for p in paths if p == str(AGENT_DIR)]
        rest = [p for p in paths if p != str(AGENT_DIR)]
        env = dict(env, PYTHONPATH=os.pathsep.join([*agent, str(self.source), *rest]))
        with _cwd(self.source):
            return super().start(env)


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@dataclass(frozen=True)
class Diagnosis:
    out: Path  # holds report.md (side by side) and one folder per strategy
    runs: dict[str, dict]  # strategy -> its report.json

    def finding(self, strategy: str, rule: str) -> dict | None:
        return next((f for f in self.runs[strategy]["findings"] if f["id"] == rule), None)

    def tok_s(self, strategy: str) -> float | None:
        return (self.runs[strategy].get("throughput") or {}).get("e2e_decode_tok_s")


def run_diagnose(config: DemoConfig, history: ScratchHistory, model: Path, say: Say) -> Diagnosis:
    """Each strategy under the probes (agent stacks: no ptrace needed), then the comparison."""
    from ft.diagnose.compare import write_comparison
    from ft.diagnose.runner import DiagnoseConfig, diagnose

    out = config.out / "diagnose"
    spec = WorkloadSpec(prompts=config.diagnose_prompts, max_tokens=config.max_tokens)
    runs = {}
    for strategy in STRATEGIES:
        say(f"diagnose: ft serve --moe-strategy {strategy} at {history.head_sha[:10]}, "
            f"{spec.prompts} requests x {spec.max_tokens} tokens under the probes")  # fmt: skip
        log = out / strategy / "target.log"
        target = SourceServer(history.repo, strategy, config.engine_flags(model), log, spec)
        dc = DiagnoseConfig(out / strategy, duration=600.0, stack_source="agent")
        outcome, runs[strategy] = diagnose(target, dc)
        if outcome.signal_num is not None:  # Ctrl-C / SIGTERM: the report is written, stop here
            raise KeyboardInterrupt
        tok_s = (runs[strategy].get("throughput") or {}).get("e2e_decode_tok_s")
        speed = f"{tok_s:.1f} tok/s" if tok_s is not None else "no decode figure"
        say(f"diagnose: {strategy} stopped by {outcome.stopped_by}: {speed}")
    write_comparison(out, runs)
    return Diagnosis(out, runs)


def run_bisect(config: DemoConfig, history: ScratchHistory, model: Path, say: Say) -> dict:
    """Engine mode over GOOD_TAG..HEAD of the scratch repo, state and report under OUT/bisect."""
    from ft.bisect.driver import bisect

    return bisect(bisect_options(config, history, model), lambda msg: say(f"bisect: {msg}"))


def bisect_options(config: DemoConfig, history: ScratchHistory, model: Path):
    """The demo's `ft bisect` options (a driver.BisectOptions)."""
    from ft.bisect.config import BisectConfig
    from ft.bisect.driver import BisectOptions, EngineOptions

    serve_args = shlex.join(["--moe-strategy", "hybrid", *config.engine_flags(model)])
    engine = EngineOptions(
        serve_args=serve_args, prompts=config.prompts, max_tokens=config.max_tokens,
        start_timeout_s=300.0, workload_timeout_s=300.0,
    )  # fmt: skip
    return BisectOptions(
        range=f"{GOOD_TAG}..{history.head_sha}", repo=str(history.repo),
        search=BisectConfig(repeats=config.repeats), engine=engine,
        out=str(config.out / "bisect"),
    )  # fmt: skip
