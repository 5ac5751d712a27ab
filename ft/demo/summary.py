"""The demo's closing text: where the three reports are, and a summary to paste into an issue."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from ft import __version__, cpuinfo
from ft.demo.config import CACHE_RATE, MODEL_DTYPE, DemoConfig
from ft.demo.edits import PLANTED_FUNCTION
from ft.demo.history import GOOD_TAG, ScratchHistory
from ft.demo.prepare import ProfileChoice
from ft.demo.stages import Diagnosis

SEED_SHAPE_SLOWDOWN = 2.0  # offload / broken hybrid at least this: far slower, as in the seed


@dataclass(frozen=True)
class Outcome:
    """What the demo set out to show, and whether it did."""

    hot: dict | None  # the hot-thread finding of the hybrid run
    pool_idle: dict | None  # its cpu-pool-idle finding
    inline_named: bool  # the hot thread's frames include the planted inline function
    culprit_sha: str | None
    found_planted: bool
    slowdown: float | None  # offload's decode tok/s over the broken hybrid's

    @property
    def hybrid_far_slower(self) -> bool:
        """The seed's shape: the broken hybrid at most half of offload (the seed: 28x)."""
        return self.slowdown is not None and self.slowdown >= SEED_SHAPE_SLOWDOWN

    @property
    def shown(self) -> bool:
        return (
            self.hybrid_far_slower
            and self.inline_named
            and self.pool_idle is not None
            and self.found_planted
        )


def judge(diagnosis: Diagnosis, rep: dict, history: ScratchHistory) -> Outcome:
    hot = diagnosis.finding("hybrid", "hot-thread")
    frames = (hot or {}).get("evidence", {}).get("hottest_frames") or []
    culprit = (rep.get("culprit") or {}).get("sha")
    hybrid, offload = diagnosis.tok_s("hybrid"), diagnosis.tok_s("offload")
    return Outcome(
        hot, diagnosis.finding("hybrid", "cpu-pool-idle"),
        any(PLANTED_FUNCTION in f for f in frames), culprit, culprit == history.planted_sha,
        offload / hybrid if hybrid and offload else None,
    )  # fmt: skip


def report_paths(profile: ProfileChoice, diagnosis: Diagnosis, rep: dict) -> dict[str, Path]:
    return {
        "bandwidth profile": profile.path,
        "diagnose report": diagnosis.out / "report.md",
        "bisect report": Path(rep["out"]) / "report.md",
    }


def summary_markdown(
    config: DemoConfig, history: ScratchHistory, diagnosis: Diagnosis, rep: dict,
    outcome: Outcome, paths: dict[str, Path],
) -> str:  # fmt: skip
    hybrid, offload = diagnosis.tok_s("hybrid"), diagnosis.tok_s("offload")
    lines = [
        f"### hybrid decode collapse, diagnosed and bisected with `ft demo` (ft {__version__})",
        "",
        f"**Symptom.** On the same tree, `--moe-strategy hybrid` decodes at {_tok(hybrid)}, "
        f"`offload` at {_tok(offload)}{_ratio(hybrid, offload)}; {GOOD_TAG} served hybrid at "
        f"{_tok(rep['endpoints'].get('before'))} on this box. Model: synthetic Qwen3-MoE "
        f"(`demo` preset, {MODEL_DTYPE}), expert cache {CACHE_RATE:.0%} of the experts, "
        f"device {config.device}.",
        "",
        "**Diagnosis** (`ft diagnose --strategy hybrid --vs offload`, in-process stack agent, "
        f"no ptrace): {outcome.hot['title'] if outcome.hot else 'no hot thread was found.'}",
    ]
    if outcome.pool_idle:
        lines.append(f"Also: {outcome.pool_idle['title']}.")
    lines += ["", _culprit_text(rep, history), ""]
    lines += [f"- {name}: `{path}`" for name, path in paths.items()]
    lines += ["", f"Box: {_box()}."]
    return "\n".join(lines) + "\n"


def _culprit_text(rep: dict, history: ScratchHistory) -> str:
    head = (
        f"**Culprit** (`ft bisect {GOOD_TAG}..HEAD`, engine mode, {rep['samples_taken']} samples)"
    )
    c = rep.get("culprit")
    if not c:
        return f"{head}: none found: {rep['message']}."
    note = (rep.get("confirmation") or {}).get("note") or rep["endpoints"]["text"]
    planted = (
        "the commit the demo planted"
        if c["sha"] == history.planted_sha
        else f"NOT the planted {history.planted_sha[:10]}"
    )
    return (
        f'{head}: `{c["sha"][:10]}` "{c["subject"]}" by {c["author"]}, {c["date"][:10]} '
        f"({planted}); {note}."
    )


def _tok(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} tok/s"


def _ratio(slow: float | None, fast: float | None) -> str:
    if not slow or not fast:
        return ""
    return f" ({fast / slow:.1f}x slower)" if fast > slow else " (no slower)"


def _box() -> str:
    import torch

    return (
        f"{cpuinfo.model_name()}, {cpuinfo.physical_cores()} physical cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
