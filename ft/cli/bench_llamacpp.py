"""`ft bench llamacpp`: ft's decode tok/s beside a llama.cpp build's, one checkpoint and budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ft.cli.bench import bench_app
from ft.report import write_json_atomic, write_text_atomic


def register(app: typer.Typer) -> None:
    """`ft bench llamacpp` lives on the bench group (ft/cli/bench.py)."""
    bench_app.command("llamacpp")(bench_llamacpp)


def bench_llamacpp(
    build: Annotated[
        Path, typer.Option(help="llama.cpp CMake build folder holding bin/llama-bench.")
    ],
    model: Annotated[
        Path, typer.Option(help="Checkpoint (HF layout, unquantised); converted to GGUF once.")
    ],
    int8_model: Annotated[
        Path | None,
        typer.Option(help="Its int8-expert twin: ft int8 beside llama.cpp's Q8_0 of --model."),
    ] = None,
    gpu_memory_limit: Annotated[
        float | None,
        typer.Option(help="GiB budget: adds offload / hybrid beside --n-cpu-moe and exps=CPU."),
    ] = None,
    tokens: Annotated[int, typer.Option(help="Decode tokens timed (llama-bench -n).")] = 64,
    repetitions: Annotated[int, typer.Option(help="llama-bench -r.")] = 3,
    warmup: Annotated[int, typer.Option(help="ft decode steps dropped before timing.")] = 4,
    device: Annotated[str | None, typer.Option(help="ft's device: cpu | cuda.")] = None,
    threads: Annotated[int | None, typer.Option(help="llama-bench -t (default: its own).")] = None,
    llamacpp_src: Annotated[
        Path | None, typer.Option(help="llama.cpp source tree (default: the build's).")
    ] = None,
    gguf_dir: Annotated[
        Path | None, typer.Option(help="Where GGUFs are kept (default: MODEL/../gguf).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Folder: write llamacpp.md and llamacpp.json.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decode tok/s at batch 1 of ft and llama.cpp on one checkpoint: all on the GPU, and under
    --gpu-memory-limit with experts on the CPU (--n-cpu-moe, -ot exps=CPU), with ratios."""
    from ft.bench.llamacpp_compare import CompareConfig, markdown, run_compare

    cfg = CompareConfig(
        build=str(build), model=str(model), int8_model=str(int8_model) if int8_model else None,
        budget_gib=gpu_memory_limit, tokens=tokens, repetitions=repetitions, warmup=warmup,
        device=device, threads=threads, source=str(llamacpp_src) if llamacpp_src else None,
        gguf_dir=str(gguf_dir) if gguf_dir else None,
    )  # fmt: skip
    err = Console(stderr=True)

    def save(report: dict) -> None:
        if out:
            write_json_atomic(out / "llamacpp.json", report)
            write_text_atomic(out / "llamacpp.md", markdown(report) + "\n")

    def log(line: str) -> None:
        err.print(f"[dim]{line}[/dim]", highlight=False, soft_wrap=True)

    report = run_compare(cfg, log=log, save=save)
    save(report)
    table = markdown(report)
    typer.echo(json.dumps(report) if as_json else table)
