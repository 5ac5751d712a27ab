"""`ft bench cpu-moe`: the CPU MoE pool's throughput per format beside the host's read rate."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ft.cli.bench import bench_app
from ft.cli.options import int_list


def register(app: typer.Typer) -> None:
    """`ft bench cpu-moe` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("cpu-moe")(bench_cpu_moe)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def bench_cpu_moe(
    formats: Annotated[
        str,
        typer.Option(help="Expert formats, comma-separated: bf16, int8, fp8_block, nvfp4, fp32."),
    ] = "bf16,int8,fp8_block,nvfp4",
    experts_per_call: Annotated[
        str, typer.Option(help="Experts in one pool call (a layer's CPU share), comma-separated.")
    ] = "1,2,8",
    tokens: Annotated[
        str, typer.Option(help="Tokens per call (decode batch), comma-separated.")
    ] = "1,4",
    threads: Annotated[
        int | None, typer.Option(help="Pool threads (default: physical cores - 1).")
    ] = None,
    calls: Annotated[int, typer.Option(help="Timed calls per cell (the median is shown).")] = 40,
    store_gib: Annotated[
        float, typer.Option(help="Each format's store, GiB: larger than the CPU's caches.")
    ] = 1.0,
    compute: Annotated[
        str,
        typer.Option(
            help="Pool compute modes, comma-separated: auto / compiled (the layer kernel), "
            "native / float32 (the row-block task path)."
        ),
    ] = "auto",  # fmt: skip
    peer: Annotated[
        str | None,
        typer.Option(
            help="Measure a peer's CPU MoE kernel beside the pool, calls interleaved: kt "
            "(kt-kernel; pip install --no-deps kt-kernel==0.7.2)."
        ),
    ] = None,
    settle: Annotated[
        bool,
        typer.Option(
            help="With --peer: start each timed call once this process's threads are idle "
            "(kt's workers spin ~50 ms after a call, on the cores the next call needs)."
        ),
    ] = True,
    interleave: Annotated[
        bool,
        typer.Option(
            help="With --peer: alternate the two sides' calls; --no-interleave: each cell's "
            "pool calls back to back, then the peer's (each side's steady state)."
        ),
    ] = True,
    phases: Annotated[
        bool,
        typer.Option(
            help="Stamp each pool call's phases per worker (wake, prep, phase 1, barrier, "
            "phase 2) and show where its time goes."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The CPU MoE pool's GB/s of expert bytes per format, experts per call and tokens, as a
    fraction of the host's read bandwidth measured in the same run (docs/cpu-pool.md)."""
    from ft.bench.cpu_moe import CpuMoeBenchConfig, run_cpu_moe  # torch: only for this command

    cfg = CpuMoeBenchConfig(
        formats=_names(formats), experts_per_call=int_list(experts_per_call, "--experts-per-call"),
        tokens=int_list(tokens, "--tokens"), calls=calls, store_gib=store_gib, threads=threads,
        computes=_names(compute), peer=peer, settle=settle, interleave=interleave,
        phases=phases,
    )  # fmt: skip
    err = Console(stderr=True)
    result = run_cpu_moe(cfg, lambda stage: err.print(f"[dim]{stage}[/dim]"))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    _render(result)


def _render(result: dict) -> None:
    read, peer = result["stream_read_gbs"], result.get("peer")
    workers = result["threads"]
    computing = result.get("computing_threads", workers)
    helps = computing > workers
    who = f"{workers} worker{'s' if workers > 1 else ''}{' + the caller' if helps else ''}"
    title = (
        f"ft bench cpu-moe: {who}, D={result['hidden']} I={result['inter']}, host read {read} "
        f"GB/s at {computing} threads"
    )
    columns = ["format", "compute", "tokens", "experts/call", "us/call", "submit us", "GB/s",
               "of read"]  # fmt: skip
    if helps:
        columns.append("caller units")  # of a call's, median: what the caller's wait computed
    if peer:
        title += f"; beside {peer['name']} {peer['version']} ({peer['variant']})"
        columns += [f"{peer['name']} us/call", f"{peer['name']} GB/s", f"ft/{peer['name']}"]
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in ("format", "compute") else "right")
    for r in result["rows"]:
        cells = [r["fmt"], r["compute"], str(r["tokens"]), str(r["experts"]), f"{r['us']:.0f}",
                 f"{r['submit_us']:.0f}", f"{r['gbs']:.2f}", _fraction(r["of_read"])]  # fmt: skip
        if helps:
            cells.append(f"{r.get('caller_units', 0):g}")
        if peer and r["peer_note"]:
            cells += [r["peer_note"].split(":")[0], "", ""]
        elif peer:
            cells += [f"{r['peer_us']:.0f}", f"{r['peer_gbs']:.2f}", f"{r['ratio']:.2f}"]
        table.add_row(*cells)
    Console().print(table)
    for r in result["rows"]:
        if r.get("caller_on_worker_core"):
            Console().print(
                f"{r['fmt']} T={r['tokens']} k={r['experts']}: the caller ended "
                f"{r['caller_on_worker_core']} timed calls on a pinned worker's core (the two "
                'shared it: docs/cpu-pool.md, "Design")'
            )
        busy = r.get("busy_calls") or {}
        for side, calls in busy.items():
            if calls:
                Console().print(
                    f"{r['fmt']} T={r['tokens']} k={r['experts']}: {calls} of the {side}'s timed "
                    "calls started with this process still busy (a side's threads still "
                    "spinning): their figure carries it"
                )
    if any("phases" in r for r in result["rows"]):
        _render_phases(result)
    if peer:
        _render_layers(peer)


def _render_phases(result: dict) -> None:
    """Per cell, each worker phase's median over calls: the median worker / the slowest."""
    from ft.engine.cpu.phases import WORKER_PHASES

    table = Table(title="pool call phases, us: median worker/slowest (--phases)")
    for column in ("cell", *WORKER_PHASES, "return", "total"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for r in result["rows"]:
        p = r.get("phases")
        if p:
            cells = [f"{p[name]['median_us']:.0f}/{p[name]['max_us']:.0f}"
                     for name in WORKER_PHASES]  # fmt: skip
            table.add_row(
                f"{r['fmt']} T={r['tokens']} k={r['experts']}",
                *cells,
                f"{p['return']['median_us']:.0f}",
                f"{p['total']['median_us']:.0f}",
            )
    Console().print(table)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _render_layers(peer: dict) -> None:
    """What the peer holds per format beside our store, and why a format has no path."""
    for fmt, layer in peer["layers"].items():
        if "note" in layer:
            Console().print(f"{fmt}: {peer['name']} {layer['note']}")
            continue
        Console().print(
            f"{fmt}: {peer['name']} {layer['method']} holds {layer['held_mib']} MiB for our "
            f"{layer['ours_mib']} MiB ({layer['experts']} experts); its load grew RSS by "
            f"{layer['rss_mib']} MiB; "
            + ("it reads our store" if layer.get("reads_our_store") else "it keeps its own copy")
        )
