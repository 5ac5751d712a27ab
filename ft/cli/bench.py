"""`ft bench ...`: one group; each benchmark registers its command from its own module."""

from __future__ import annotations

import typer

bench_app = typer.Typer(
    help="Benchmarks: bandwidth profile, decode speed, serving.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
