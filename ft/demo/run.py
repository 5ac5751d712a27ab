"""`ft demo`, stage by stage; the CLI (ft/cli/demo.py) only renders what this reports.

1 model + `ft bench bw --quick`   2 scratch repo with a planted regression
3 `ft diagnose --strategy hybrid --vs offload` at HEAD   4 `ft bisect v0.1.2..HEAD`
5 where the reports are + a summary for an issue
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ft.demo.config import DemoConfig
from ft.demo.history import ScratchHistory, build_history
from ft.demo.prepare import ProfileChoice, check_out_dir, demo_model, isolated_env, measure_profile
from ft.demo.stages import Diagnosis, run_bisect, run_diagnose
from ft.demo.summary import Outcome, judge, report_paths, summary_markdown
from ft.report import write_text_atomic

STAGES = (
    "model and bandwidth profile",
    "scratch repository with a planted regression",
    "diagnose hybrid vs offload at HEAD",
    "bisect the scratch history",
    "reports and summary",
)


class DemoUI(Protocol):
    def stage(self, number: int, title: str) -> AbstractContextManager[None]: ...
    def say(self, message: str) -> None: ...
    def history_built(self, history: ScratchHistory) -> None: ...
    def diagnosed(self, diagnosis: Diagnosis) -> None: ...
    def bisected(self, rep: dict) -> None: ...


@dataclass
class DemoResult:
    profile: ProfileChoice
    history: ScratchHistory
    diagnosis: Diagnosis
    rep: dict
    outcome: Outcome
    paths: dict[str, Path]
    summary: str
    summary_path: Path
    seconds: dict[str, float] = field(default_factory=dict)


def run_demo(config: DemoConfig, ui: DemoUI) -> DemoResult:
    check_out_dir(config.out)
    config.out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    with _stage(ui, 1, seconds):
        model = demo_model(ui.say)
        profile = measure_profile(config, ui.say)
    with isolated_env(config.out, profile.path):
        with _stage(ui, 2, seconds):
            history = build_history(config.out / "scratch")
            ui.history_built(history)
        with _stage(ui, 3, seconds):
            diagnosis = run_diagnose(config, history, model, ui.say)
            ui.diagnosed(diagnosis)
        with _stage(ui, 4, seconds):
            rep = run_bisect(config, history, model, ui.say)
            ui.bisected(rep)
    with _stage(ui, 5, seconds):
        outcome = judge(diagnosis, rep, history)
        paths = report_paths(profile, diagnosis, rep)
        text = summary_markdown(config, history, diagnosis, rep, outcome, paths)
        write_text_atomic(config.out / "summary.md", text)
    return DemoResult(profile, history, diagnosis, rep, outcome, paths, text,
                      config.out / "summary.md", seconds)  # fmt: skip


@contextmanager
def _stage(ui: DemoUI, number: int, seconds: dict[str, float]) -> Iterator[None]:
    start = time.monotonic()
    with ui.stage(number, STAGES[number - 1]):
        yield
    seconds[STAGES[number - 1]] = time.monotonic() - start
