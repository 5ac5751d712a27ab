"""`ft env`: the machine facts a bug report needs (the full collector lives in ft/probes)."""

from __future__ import annotations

import json
import platform
import sys
from typing import Annotated

import typer

from ft import __version__


def register(app: typer.Typer) -> None:
    app.command("env")(env)


def env(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print ft, Python, torch and platform versions."""
    import torch

    facts = {
        "ft": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if json_out:
        typer.echo(json.dumps(facts, indent=2))
    else:
        for key, value in facts.items():
            typer.echo(f"{key}: {value}")
