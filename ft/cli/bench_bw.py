"""`ft bench bw`: measure the box, write the bandwidth profile, show what it recommends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ft.cli.bench import bench_app
from ft.cli.profile import render_profile
from ft.profile import DEFAULT_THRESHOLD, Profile, default_path
from ft.report import write_json_atomic


def register(app: typer.Typer) -> None:
    """`ft bench bw` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("bw")(bench_bw)


def bench_bw(
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write the profile here (default: $FT_CACHE_DIR/benchbw.json)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Small synthetic experts, few samples (< 1 min).")
    ] = False,
    formats: Annotated[
        str,
        typer.Option(
            "--formats",
            help="Expert formats to measure, comma-separated: bf16, int8, fp8_block, nvfp4 "
            "(the default: all), fp32 (the pool's float32 ceiling).",
        ),
    ] = "bf16,int8,fp8_block,nvfp4",
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="CPU MoE pool threads (default: physical cores - 1)."),
    ] = None,
    threshold: Annotated[
        float, typer.Option("--threshold", help="cpu_moe/pcie_gather ratio at which hybrid wins.")
    ] = DEFAULT_THRESHOLD,
    json_out: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Measure host read, PCIe, CPU MoE pool and expert gather bandwidth; write the profile."""
    from ft.bench.bw import BwConfig, run_bw  # torch is imported only for this command

    names = tuple(f.strip() for f in formats.split(",") if f.strip())
    cfg = BwConfig(formats=names, threads=threads, threshold=threshold, quick=quick)
    path = out or default_path()
    err = Console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=None)
        profile = run_bw(cfg, lambda stage: progress.update(task, description=stage, advance=1))
    write_json_atomic(path, profile)
    if json_out:
        typer.echo(json.dumps(profile, indent=2))
        return
    render_profile(Profile(profile, path), Console())
    err.print(f"wrote {path}")
