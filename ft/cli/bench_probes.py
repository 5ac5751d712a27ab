"""`ft bench probes`: what `ft diagnose`'s probes cost decode, on one warm server."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ft import settings
from ft.bench.probe_cost import (
    METRICS,
    Trial,
    baseline_figures,
    overheads,
    probe_settings,
    run_trials,
)
from ft.bench.probe_live import live_probes
from ft.bench.server_process import start_server
from ft.bench.workload import run_workload
from ft.cli.bench import bench_app
from ft.diagnose.runner import DiagnoseConfig
from ft.errors import FtError
from ft.probes.stacks import STACK_SOURCES


def bench_probes(
    model: Annotated[str | None, typer.Option(help="Model directory for the server.")] = None,
    serve_args: Annotated[str, typer.Option(help="Extra `ft serve` flags, quoted.")] = "",
    sources: Annotated[
        str, typer.Option(help="Stack sources to measure, comma-separated: agent,py-spy,auto.")
    ] = "agent,py-spy,auto",
    repeats: Annotated[int, typer.Option(min=1, help="Rounds; each runs every setting once.")] = 5,
    fast: Annotated[
        float, typer.Option(min=0, help="Also each source with its intervals divided by this.")
    ] = 5.0,
    prompts: Annotated[int, typer.Option(min=1, help="Requests per run (fixed, seeded).")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to decode per request.")] = 64,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the prompt set.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Write every trial and figure as JSON.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decode tok/s without probes and under each stack source, alternated; overhead with 95% CI."""
    chosen = [s.strip() for s in sources.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STACK_SOURCES]
    if bad or not chosen:
        raise FtError(f"--sources takes {', '.join(STACK_SOURCES)}; got {sources!r}")
    defaults = DiagnoseConfig(out_dir=Path("."))
    probe_set = probe_settings(chosen, defaults.interval, defaults.agent_interval, fast or None)
    workload = dict(prompts=prompts, max_tokens=max_tokens, concurrency=concurrency, seed=seed)
    api_key = settings.api_key()
    flags = (["--model", model] if model else []) + shlex.split(serve_args)
    flags += ["--api-key", api_key] if api_key else []
    log = Console(stderr=True, quiet=as_json)
    with tempfile.TemporaryDirectory(prefix="ft-agent-attach-") as folder:
        env = dict(os.environ) | {settings.AGENT_ATTACH: folder}
        with start_server(flags, env=env) as server:

            def measure() -> dict:
                result = run_workload(server.url, api_key=api_key, **workload)
                return {m: getattr(result, m) for m in METRICS}

            measure()  # warm-up: compilation and graph capture are not decode
            trials = run_trials(
                probe_set, repeats, measure,
                lambda s: live_probes(server.proc.pid, Path(folder), s),
                on_trial=lambda t: log.print(_trial_line(t)),
            )  # fmt: skip
    result = {
        "kind": "ft-bench-probes",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join(["ft", *sys.argv[1:]]),
        "workload": workload,
        "settings": [s.to_json() for s in probe_set],
        "trials": [asdict(t) for t in trials],
        "baseline": {m: baseline_figures(trials, m) for m in METRICS},
        "overheads": [asdict(o) for m in METRICS for o in overheads(trials, m)],
    }
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _render(result)


def _trial_line(t: Trial) -> str:
    figures = "  ".join(f"{m} {v:.2f}" if v else f"{m} -" for m, v in t.figures.items())
    return f"round {t.round + 1} {t.setting:>12}: {figures}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _render(result: dict) -> None:
    """One row a setting: median tok/s, spread, overhead with its 95% interval, per metric."""
    table = Table(title=f"ft bench probes: {result['command']}")
    table.add_column("setting")
    for metric in ("e2e", "engine"):
        for column in ("tok/s", "spread", "overhead [95% CI]"):
            table.add_column(f"{metric} {column}", justify="right")
    rows: dict[str, list[str]] = {"none": []}
    for base in result["baseline"].values():
        rows["none"] += [_tok(base["median"]), _pct(base["spread"]), ""]
    for o in result["overheads"]:
        ci = "" if o["low"] is None else f" [{_pct(o['low'])}, {_pct(o['high'])}]"
        cells = [_tok(o["median"]), _pct(o["spread"]), _pct(o["overhead"]) + ci]
        rows.setdefault(o["setting"], []).extend(cells)
    for name, cells in rows.items():
        table.add_row(name, *cells)
    Console().print(table)
    Console().print(
        "overhead: 1 - tok/s / the mean of the runs without probes just before and after, "
        "averaged over rounds; spread: (max - min) / median"
    )


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def register(app: typer.Typer) -> None:
    """`ft bench probes` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("probes")(bench_probes)
