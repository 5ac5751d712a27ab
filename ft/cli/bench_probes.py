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

import psutil
import typer
from rich.console import Console
from rich.table import Table

from ft import settings
from ft.bench.probe_cost import (
    METRICS,
    RATES,
    Trial,
    baseline_figures,
    overheads,
    probe_cpu_share,
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
            process = psutil.Process(server.proc.pid)

            def measure() -> dict:
                before = sum(process.cpu_times()[:2])
                result = run_workload(server.url, api_key=api_key, **workload)
                cpu_ms = 1000 * (sum(process.cpu_times()[:2]) - before)
                tokens = sum(r.tokens for r in result.requests)
                figures = {m: getattr(result, m) for m in RATES}
                return figures | {"server_cpu_ms_per_token": cpu_ms / tokens if tokens else None}

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
        "probe_cpu_share": probe_cpu_share(trials),
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
    """One row a setting: tok/s, and each metric's overhead with its 95% interval."""
    table = Table(title=f"ft bench probes: {result['command']}")
    table.add_column("setting", no_wrap=True)
    for column in ("e2e tok/s (spread)", "e2e", "engine", "CPU ms/token", "probes' CPU"):
        table.add_column(column, justify="right")
    base = result["baseline"]
    rows = {"none": [_median(base["e2e_decode_tok_s"]), "", "", "", ""]}
    rows["none"][3] = _median(base["server_cpu_ms_per_token"])
    found = {(o["setting"], o["metric"]): o for o in result["overheads"]}
    for name in dict.fromkeys(o["setting"] for o in result["overheads"]):
        e2e = found[(name, "e2e_decode_tok_s")]
        cells = [_median(e2e), _overhead(e2e), _overhead(found[(name, "engine_decode_tok_s")])]
        cells.append(_overhead(found[(name, "server_cpu_ms_per_token")]))
        share = result["probe_cpu_share"].get(name)
        cells.append("-" if share is None else f"{100 * share:.1f}% of a core")
        rows[name] = cells
    for name, cells in rows.items():
        table.add_row(name, *cells)
    console = Console()
    console.print(table)
    console.print(
        "overhead (positive: slower / costlier) = 1 - tok/s over the mean of the runs without "
        "probes just before and after, averaged over rounds, with its 95% interval; spread = "
        "(max - min) / median; CPU ms/token: the server's, its agent included; probes' CPU: "
        "ft's sampling thread and py-spy over the workload's time"
    )


def _median(figures: dict) -> str:
    spread = figures.get("spread")
    text = _tok(figures.get("median"))
    return text if spread is None else f"{text} ({100 * spread:.0f}%)"


def _overhead(o: dict) -> str:
    ci = "" if o["low"] is None else f" [{_pct(o['low'])}, {_pct(o['high'])}]"
    return _pct(o["overhead"]) + ci


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def register(app: typer.Typer) -> None:
    """`ft bench probes` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("probes")(bench_probes)
