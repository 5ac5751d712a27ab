"""`ft bench decode`: decode tok/s per strategy and batch beside the bandwidth roofline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ft.cli.bench import bench_app
from ft.cli.options import EngineFlags, engine_options, int_list
from ft.report import write_json_atomic


def register(app: typer.Typer) -> None:
    """`ft bench decode` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("decode")(bench_decode)


# The bench picks the strategy, cache-free resident, KV size and batch itself.
_BENCH_SETS = ("moe_strategy", "moe_cache_size", "moe_cache_auto", "kv_reserve_tokens",
               "max_num_seqs", "max_model_len", "cpu_moe_inline", "bw_profile")  # fmt: skip


@engine_options(exclude=_BENCH_SETS)
def bench_decode(
    strategies: Annotated[
        str | None,
        typer.Option(help="Comma-separated (default: every strategy this engine has)."),
    ] = None,
    batch: Annotated[str, typer.Option(help="Decode batch sizes, comma-separated.")] = "1",
    tokens: Annotated[int, typer.Option(help="Timed decode steps per strategy and batch.")] = 32,
    warmup: Annotated[int, typer.Option(help="Decode steps dropped before timing.")] = 4,
    profile: Annotated[
        Path | None,
        typer.Option(help="Bandwidth profile for the roofline (default: `ft bench bw`'s)."),
    ] = None,
    peer: Annotated[
        str | None, typer.Option(help="Add a baseline measured the same way: accelerate.")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(help="Folder: profile a few extra decode steps per run (Chrome trace, ops)."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Also write the JSON report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    engine: EngineFlags,
) -> None:
    """Decode tok/s per strategy and batch, the roofline of each run, and measured/roofline."""
    from ft.bench.decode import DecodeBenchConfig, available_strategies

    names = tuple(s.strip() for s in strategies.split(",")) if strategies else None
    profile_path = str(profile) if profile else None
    # offload: a strategy every cache flag is valid for; each run then sets its own
    shared = engine.config(moe_strategy="offload", bw_profile=profile_path)
    cfg = DecodeBenchConfig(
        engine=shared, strategies=names or available_strategies(),
        batches=int_list(batch, "--batch"), tokens=tokens, warmup=warmup, profile=profile_path,
        peer=peer, trace=str(trace) if trace else None,
    )  # fmt: skip
    report = _run(cfg)
    if out:
        write_json_atomic(out, report)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        render(report, Console())


def _run(cfg) -> dict:
    from ft.bench.decode import run_decode_bench

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=cfg.total_steps)
        return run_decode_bench(cfg, lambda what, n: bar.update(task, description=what, advance=n))


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _mb(step: dict, key: str) -> str:
    return _num(step[key] / 1e6 if step.get(key) is not None else None)


def render(report: dict, console: Console) -> None:
    table = Table(
        title=f"ft bench decode: {report['model']} ({report['device']}, {report['dtype']}, "
        f"experts {report.get('expert_format', 'bf16')})"
    )
    heads = ("strategy", "batch", "tok/s", "roofline", "ratio", "bound", "HBM MB",
             "PCIe MB", "host MB", "note")  # fmt: skip
    for head in heads:
        table.add_column(head, justify="left" if head in ("strategy", "note") else "right")
    for r in report["results"]:
        roof, step = r.get("roofline") or {}, r.get("per_step") or {}
        table.add_row(
            r["strategy"], str(r["batch"]), _num(r["tok_s"]), _num(roof.get("tok_s")),
            _num(r.get("ratio"), "{:.0%}"), roof.get("bound") or "-", _mb(step, "hbm_bytes"),
            _mb(step, "pcie_bytes"), _mb(step, "host_bytes"), r.get("error") or "",
        )  # fmt: skip
    console.print(table)
    kernels = sorted({r["kernel"] for r in report["results"] if r.get("kernel")})
    console.print(f"per decode step; roofline in tok/s; expert kernels: {', '.join(kernels)}")
    bw = report["bandwidth"]
    console.print(
        f"links: HBM {_num(bw['hbm_gbs'])} GB/s ({bw['source']['hbm']}), "
        f"PCIe {_num(bw['pcie_gbs'])} GB/s, host memory {_num(bw['host_gbs'])} GB/s"
        + (f"  note: {bw['note']}" if bw.get("note") else "")
    )
    for r in report["results"]:
        label, step = f"{r['strategy']} b{r['batch']}", r.get("per_step") or {}
        if step.get("cpu_layers"):
            console.print(round_trip_line(label, step))
        if (r.get("trace") or {}).get("timeline"):
            console.print(timeline_line(label, r["trace"]["timeline"]))


def round_trip_line(label: str, step: dict) -> str:
    """Hybrid's decode layers with CPU experts (per_step's cpu_layers, cpu_<part>_us): the
    host's time in each part of one such layer's round trip, while its device work waits."""
    from ft.engine.strategies.hybrid import ROUND_TRIP

    layers = step["cpu_layers"]
    us = {part: step[f"cpu_{part}_us"] / layers for part in ROUND_TRIP}
    parts = ", ".join(f"{part} {value:.0f}" for part, value in us.items())
    total = sum(us.values())
    return (
        f"cpu layers {label}: {layers:.1f} a step, {step['experts_cpu'] / layers:.1f} experts "
        f"each; {total:.0f} us each on the host ({parts}), {layers * total / 1000:.2f} ms a step"
    )


def timeline_line(label: str, t: dict) -> str:
    """One traced run's device timeline (us per step, decode_trace.device_timeline) in ms."""
    ms = lambda us: f"{us / 1000:.2f} ms"  # noqa: E731
    return (
        f"trace {label}: step {ms(t['step'])}: GPU computes {ms(t['compute'])}, waits for "
        f"copies {ms(t['wait_copy'])}, for the host {ms(t['wait_host'])}; PCIe copies "
        f"{ms(t['pcie'])} ({t['pcie'] / t['step']:.0%} of the step)"
    )
