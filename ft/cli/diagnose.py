"""`ft diagnose`: run a target under the probes and write a report that names the hot thread."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ft.errors import FtError

_ENGINE_MODULES = ("ft.engine.serve.server", "ft.bench.workload")


def register(app: typer.Typer) -> None:
    settings = {"allow_extra_args": True, "ignore_unknown_options": True}
    app.command("diagnose", context_settings=settings)(diagnose)


def diagnose(
    ctx: typer.Context,
    cmd: Annotated[
        str | None, typer.Option("--cmd", help="Run this command under the probes (any program).")
    ] = None,
    strategy: Annotated[
        str | None, typer.Option("--strategy", help="Engine mode: `ft serve --moe-strategy S`.")
    ] = None,
    pid: Annotated[
        int | None,
        typer.Option("--pid", min=1, help="Attach to this running process (never stopped)."),
    ] = None,
    vs: Annotated[
        str | None, typer.Option("--vs", help="Engine mode: run this strategy too, side by side.")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Engine mode: model dir.")] = None,
    prompts: Annotated[int, typer.Option("--prompts", help="Engine mode: requests.")] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per request.")] = 64,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests at once.")] = 1,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration", help="Seconds to sample at most (default 10; engine mode 900: a limit)."
        ),
    ] = None,
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

    --cmd runs any program; --strategy starts `ft serve` (unknown options go to it) + workload;
    --pid attaches to a process that is already running, such as a service.

    Writes report.md, report.json, stacks.collapsed, timeline.png, samples.jsonl into --out.

    Ctrl-C, SIGTERM or SIGHUP stop early and still write the report.
    """
    from ft.diagnose.runner import DiagnoseConfig

    if sum(mode is not None for mode in (cmd, strategy, pid)) != 1:
        raise FtError('give one of --cmd "COMMAND", --strategy S or --pid PID')
    if cmd is not None and (ctx.args or vs):
        raise FtError(f"unexpected with --cmd: {' '.join(ctx.args) or '--vs'}")
    if pid is not None and (ctx.args or vs):
        raise FtError(f"unexpected with --pid: {' '.join(ctx.args) or '--vs'}")
    out = out or Path("ft-diagnose-" + time.strftime("%Y%m%d-%H%M%S"))
    duration = duration if duration is not None else (10.0 if strategy is None else 900.0)
    config = DiagnoseConfig(out, duration, interval, stack_source)
    if pid is not None:
        _run_attached(pid, config, json_out)
    elif cmd is not None:
        _run_command(cmd, config, json_out)
    else:
        serve_args = [*(["--model", model] if model else []), *ctx.args]
        spec = (prompts, max_tokens, concurrency)
        _run_engine([strategy] + ([vs] if vs else []), serve_args, spec, config, json_out)


def _run_command(cmd: str, config, json_out: bool) -> None:
    from ft.diagnose.runner import diagnose as run_diagnose
    from ft.diagnose.targets import CommandTarget

    target = CommandTarget(cmd, config.out_dir / "target.log")
    outcome, report = run_diagnose(target, config)
    _show(report, config.out_dir, json_out)
    if outcome.signal_num is not None:
        sys.exit(128 + outcome.signal_num)
    if outcome.failure:  # the report stands; the exit code is the command's own, as with time(1)
        typer.echo(f"error: {outcome.failure}", err=True)
        code = outcome.exit_code or 1
        sys.exit(code if code > 0 else 128 - code)


def _run_attached(pid: int, config, json_out: bool) -> None:
    """`--pid`: the same run and report as --cmd; ft detaches at the end, the target runs on."""
    from ft.diagnose.attach import PidTarget
    from ft.diagnose.runner import diagnose as run_diagnose

    outcome, report = run_diagnose(PidTarget(pid), config)
    _show(report, config.out_dir, json_out)
    if outcome.signal_num is not None:
        sys.exit(128 + outcome.signal_num)


def _run_engine(strategies: list[str], serve_args: list[str], spec, config, json_out) -> None:
    from dataclasses import replace

    from ft.diagnose.compare import write_comparison
    from ft.diagnose.runner import diagnose as run_diagnose
    from ft.diagnose.server_target import ServerTarget, WorkloadSpec

    missing = [m for m in _ENGINE_MODULES if not _importable(m)]
    if missing:
        raise FtError(f"engine mode needs {', '.join(missing)}, which this install lacks")
    from ft.engine.config import STRATEGIES, check_choice

    for strategy in strategies:  # before the first run, not after it (--vs)
        check_choice("strategy", strategy, STRATEGIES)
    runs = {}
    for strategy in strategies:
        out = config.out_dir / strategy if len(strategies) > 1 else config.out_dir
        target = ServerTarget(strategy, serve_args, out / "target.log", WorkloadSpec(*spec))
        outcome, runs[strategy] = run_diagnose(target, replace(config, out_dir=out))
        if outcome.signal_num is not None:
            _show(runs[strategy], out, json_out)
            sys.exit(128 + outcome.signal_num)
        if outcome.failure:  # no diagnosis to show: the server's own error says why
            if json_out:
                typer.echo(json.dumps(runs[strategy], indent=2, default=str))
            raise FtError(f"{outcome.failure} (log: {out / 'target.log'})")
    if len(runs) == 1:
        _show(runs[strategies[0]], config.out_dir, json_out)
        return
    md = write_comparison(config.out_dir, runs)
    typer.echo(json.dumps(runs, indent=2, default=str) if json_out else md)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


def _show(report: dict, out: Path, json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    from rich.console import Console

    console = Console()
    run = report["run"]
    console.print(f"stopped by {run['stopped_by']} after {run['duration_s']:.1f} s")
    tp = report.get("throughput") or {}
    if tp.get("e2e_decode_tok_s") is not None:
        console.print(f"decode {tp['e2e_decode_tok_s']:.2f} tok/s end to end", highlight=False)
    elif tp.get("error"):
        console.print(f"workload failed: {tp['error']}", highlight=False)
    for f in report["findings"]:
        colour = {"critical": "red", "warning": "yellow"}.get(f["severity"], "cyan")
        console.print(f"[{colour}]{f['severity']}[/] {f['id']}: {f['title']}", highlight=False)
    if not report["findings"]:
        console.print("no findings")
    console.print(f"report: {out / 'report.md'}")
