"""`ft demo`: the seed's story end to end (ft/demo/run.py), rendered for people."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ft.errors import FtError

_SMALL = "Smaller settings (tests, a quick look)"


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Folder for everything the demo writes (default ./ft-demo-DATE-TIME)."
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu | cuda (default: cuda when available).")
    ] = None,
    prompts: Annotated[
        int, typer.Option("--prompts", help="Bisect: requests per sample.", rich_help_panel=_SMALL)
    ] = 2,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens per request.", rich_help_panel=_SMALL)
    ] = 16,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Bisect: samples per commit.", rich_help_panel=_SMALL)
    ] = 3,
    diagnose_prompts: Annotated[
        int,
        typer.Option(
            "--diagnose-prompts", help="Diagnose: requests per strategy.", rich_help_panel=_SMALL
        ),
    ] = 6,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the outcome as JSON (progress goes to stderr).")
    ] = False,
) -> None:
    """Plant the seed's hybrid regression in a scratch copy of ft, diagnose it, bisect it.

    Makes a small synthetic model, measures the box (bench bw --quick), builds a scratch git
    history from the installed source with one bad commit, runs `ft diagnose --strategy hybrid
    --vs offload` and `ft bisect` on it, and prints where the reports are. Nothing of yours is
    touched but the bandwidth profile, written only where you have none.
    """
    from ft.bisect.measure import Interrupted
    from ft.demo.config import DemoConfig
    from ft.demo.run import run_demo

    out = (out or Path("ft-demo-" + time.strftime("%Y%m%d-%H%M%S"))).resolve()
    config = DemoConfig(out, device or _default_device(), prompts, max_tokens, repeats,
                        diagnose_prompts)  # fmt: skip
    if config.device == "cuda" and _default_device() != "cuda":
        raise FtError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    ui = RichUI(Console(stderr=json_out, highlight=False))
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops as cleanly as Ctrl-C
    try:
        result = run_demo(config, ui)
    except (KeyboardInterrupt, Interrupted):
        typer.echo(f"error: interrupted; what was done so far is under {out}", err=True)
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(_as_json(result), indent=2))
    else:
        ui.finish(result)
    if not result.outcome.shown:
        raise FtError(f"the demo did not show what it should: {_missing(result.outcome)} "
                      f"(reports under {out})")  # fmt: skip


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _missing(outcome) -> str:
    if not outcome.hybrid_far_slower:
        ratio = "unknown" if outcome.slowdown is None else f"{outcome.slowdown:.1f}x"
        return f"the broken hybrid was not far slower than offload (offload/hybrid {ratio})"
    if not outcome.inline_named:
        return "the diagnosis did not name the inline frames"
    if outcome.pool_idle is None:
        return "the diagnosis did not find the CPU MoE pool idle"
    return f"the bisect named {str(outcome.culprit_sha)[:10]}, not the planted commit"


def _as_json(result) -> dict:
    o = result.outcome
    return {
        "out": str(result.summary_path.parent),
        "reports": {k: str(v) for k, v in result.paths.items()},
        "summary": str(result.summary_path),
        "profile_is_default": result.profile.wrote_default,
        "planted": {"sha": result.history.planted_sha, "subject": result.history.planted_subject},
        "culprit": o.culprit_sha, "found_planted": o.found_planted,
        "inline_frames_named": o.inline_named, "pool_idle": o.pool_idle is not None,
        "offload_over_hybrid": o.slowdown,
        "hybrid_tok_s": result.diagnosis.tok_s("hybrid"),
        "offload_tok_s": result.diagnosis.tok_s("offload"),
        "seconds": {k: round(v, 1) for k, v in result.seconds.items()},
    }  # fmt: skip


class RichUI:
    """Progress for people: a rule per stage, a spinner with the latest event, results."""

    def __init__(self, console: Console):
        self.console = console
        self.start = time.monotonic()
        self._status = None

    @contextmanager
    def stage(self, number: int, title: str) -> Iterator[None]:
        self.console.rule(f"[bold][{number}/5] {title}")
        began = time.monotonic()
        with self.console.status(title, spinner="dots") as status:
            self._status = status
            try:
                yield
            finally:
                self._status = None
        self.console.print(f"[dim]stage {number} done in {time.monotonic() - began:.1f} s[/dim]")

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        self.console.print(f"[dim]{elapsed:6.1f}s[/dim] {message}", soft_wrap=True)
        if self._status is not None:
            self._status.update(message[:100])

    def history_built(self, history) -> None:
        import git

        table = Table(title=f"scratch history in {history.repo}", title_justify="left")
        for col in ("commit", "subject", "author"):
            table.add_column(col)
        for c in git.Repo(history.repo).iter_commits(max_count=history.commits + 1):
            mark = " [dim](planted)[/dim]" if c.hexsha == history.planted_sha else ""
            tag = " [green](v0.1.2)[/green]" if c.hexsha == history.good_sha else ""
            table.add_row(c.hexsha[:10], f"{c.summary}{mark}{tag}", c.author.name)
        self.console.print(table)

    def diagnosed(self, diagnosis) -> None:
        table = Table(title="ft diagnose --strategy hybrid --vs offload", title_justify="left")
        for col in ("strategy", "decode tok/s", "findings"):
            table.add_column(col)
        for strategy, run in diagnosis.runs.items():
            tok_s = diagnosis.tok_s(strategy)
            ids = ", ".join(f["id"] for f in run["findings"]) or "none"
            table.add_row(strategy, "-" if tok_s is None else f"{tok_s:.1f}", ids)
        self.console.print(table)
        for rule in ("hot-thread", "cpu-pool-idle"):
            if f := diagnosis.finding("hybrid", rule):
                self.console.print(f"[red]{f['severity']}[/red] {rule}: {f['title']}")

    def bisected(self, rep: dict) -> None:
        table = Table(title=f"ft bisect ({rep['direction']} is worse)", title_justify="left")
        for col in ("commit", "subject", "median tok/s", "n", "verdict"):
            table.add_column(col)
        style = {"good": "green", "bad": "red", "skip": "dim"}
        for r in rep["commits"]:
            median = "" if r["median"] is None else f"{r['median']:.1f}"
            table.add_row(r["sha"][:10], r["subject"][:60], median, str(r["n"]),
                          r["verdict"] or "", style=style.get(r["verdict"] or ""))  # fmt: skip
        self.console.print(table)
        self.console.print(f"[bold]{rep['message']}[/bold]")

    def finish(self, result) -> None:
        for name, path in result.paths.items():
            self.console.print(f"{name}: [bold]{path}[/bold]", soft_wrap=True)
        self.console.rule("paste into an issue")
        self.console.print(result.summary, markup=False, soft_wrap=True)
        self.console.rule()
        self.console.print(f"summary: {result.summary_path}  (total "
                           f"{sum(result.seconds.values()):.0f} s)", soft_wrap=True)  # fmt: skip
