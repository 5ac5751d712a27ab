"""`ft model ...`: make synthetic checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(help="Model checkpoints: make synthetic ones.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")


@model_app.command("synth")
def synth(
    out: Annotated[Path, typer.Option("--out", help="New directory for the checkpoint.")],
    preset: Annotated[
        str, typer.Option("--preset", help="tiny | qwen3-30b-a3b | seed-next.")
    ] = "tiny",
    layers: Annotated[
        int | None, typer.Option("--layers", help="Override the layer count.")
    ] = None,
    experts: Annotated[
        int | None, typer.Option("--experts", help="Override experts per layer.")
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="bfloat16 | float16 | float32.")
    ] = "bfloat16",
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    expert_format: Annotated[
        str,
        typer.Option(
            "--expert-format",
            help="bf16 | int8 | fp8_block | nvfp4: routed experts quantised as public "
            "checkpoints store them (dense weights stay --dtype).",
        ),
    ] = "bf16",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Write a synthetic Qwen3-MoE checkpoint (HF layout) and print its measured routing."""
    from rich.console import Console
    from rich.progress import Progress

    from ft.engine.synth.checkpoint import synth_checkpoint

    with Progress(console=Console(stderr=True), transient=True, disable=json_out) as progress:
        task = progress.add_task(f"synth {preset} -> {out}", total=None)
        on_layer = lambda done, total: progress.update(task, completed=done, total=total)  # noqa: E731
        stats = synth_checkpoint(
            preset, out, layers, experts, dtype, seed, on_layer, expert_format=expert_format
        )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    if json_out:
        report = {"out": str(out), "bytes": size, "expert_format": expert_format}
        typer.echo(json.dumps({**report, **stats.__dict__}))
        return
    shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    typer.echo(f"wrote {out} ({shown}, preset {preset}, experts {expert_format})")
    typer.echo(stats.describe())
