"""`ft diagnose`: run a target under the probes and write a report that names the hot thread."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("diagnose")(diagnose)


def _default_out() -> Path:
    return Path("ft-diagnose-" + time.strftime("%Y%m%d-%H%M%S"))


def diagnose(
    cmd: Annotated[
        str | None, typer.Option("--cmd", help="Run this command under the probes (any program).")
    ] = None,
    duration: Annotated[
        float, typer.Option("--duration", help="Seconds to sample at most (less if it exits).")
    ] = 10.0,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between thread and GPU samples.")
    ] = 0.5,
    out: Annotated[
        Path | None, typer.Option("--out", help="Report folder (default ./ft-diagnose-DATE-TIME).")
    ] = None,
    stack_source: Annotated[
        str,
        typer.Option(
            "--stack-source",
            help="auto: in-process agent, plus py-spy where ptrace works; agent; py-spy.",
        ),
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print report.json.")] = False,
) -> None:
    """Sample threads, GPU and Python stacks of a target, then apply the findings rules.

    Writes report.md (paste into an issue), report.json, stacks.collapsed, timeline.png and the raw
    samples.jsonl into the report folder. Ctrl-C stops early and still writes the report.
    """
    from ft.diagnose.runner import DiagnoseConfig
    from ft.diagnose.runner import diagnose as run_diagnose
    from ft.diagnose.targets import CommandTarget
    from ft.errors import FtError

    if cmd is None:
        raise FtError('give --cmd "COMMAND" (the engine mode, --strategy, is not built yet)')
    out = out or _default_out()
    config = DiagnoseConfig(out, duration, interval, stack_source)
    target = CommandTarget(cmd, out / "target.log")
    outcome, report = run_diagnose(target, config)
    if json_out:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        _print(report, out)
    if outcome.signal_num is not None:
        sys.exit(128 + outcome.signal_num)


def _print(report: dict, out: Path) -> None:
    from rich.console import Console

    console = Console()
    run = report["run"]
    console.print(f"stopped by {run['stopped_by']} after {run['duration_s']:.1f} s")
    for f in report["findings"]:
        colour = {"critical": "red", "warning": "yellow"}.get(f["severity"], "cyan")
        console.print(f"[{colour}]{f['severity']}[/] {f['id']}: {f['title']}", highlight=False)
    if not report["findings"]:
        console.print("no findings")
    console.print(f"report: {out / 'report.md'}")
