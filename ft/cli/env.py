"""`ft env`: the machine facts a bug report needs (the collector lives in ft/probes/env.py)."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("env")(env)


def env(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print versions, GPU, driver, PCIe, CPU, ISA, NUMA, ptrace_scope and relevant variables."""
    from ft.probes.env import collect

    facts = collect()
    if json_out:
        typer.echo(json.dumps(facts, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    for key, value in facts.items():
        if key != "env":
            table.add_row(key, _text(value))
    for name, value in facts["env"].items():
        table.add_row(f"${name}", value)
    Console().print(table)


def _text(value) -> str:
    if isinstance(value, list | dict):
        return json.dumps(value, default=str)
    return "-" if value is None else str(value)
