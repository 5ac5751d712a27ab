"""The `ft` command: one typer app, one module per command group, errors caught once here."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from ft import __version__
from ft.errors import FtError


class _FtGroup(TyperGroup):
    """Turns every user mistake into one `error:` line and exit code 1, never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except FtError as exc:
            _fail(str(exc))
        except typer.Abort:
            typer.echo("error: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            if not _is_usage_error(exc):
                raise
            if not exc.format_message():  # bare `ft`: the help was the answer
                sys.exit(0)
            _fail(exc.format_message())
        sys.exit(rv if isinstance(rv, int) else 0)


def _is_usage_error(exc: Exception) -> bool:
    """click's (or typer's vendored click's) ClickException, whichever this typer ships."""
    return hasattr(exc, "format_message") and hasattr(exc, "exit_code")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    sys.exit(1)


app = typer.Typer(
    cls=_FtGroup,
    name="ft",
    help="Diagnose and bisect MoE decode slowdowns, around a reference MoE engine.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Diagnose and bisect MoE decode slowdowns, around a reference MoE engine."""


def _register() -> None:
    """Attach each command group; one line per module in ft/cli."""
    from ft.cli import (
        bench,
        bench_bw,
        bench_cpu_moe,
        bench_decode,
        bench_llamacpp,
        bench_probes,
        bench_serve,
        bisect,
        demo,
        diagnose,
        env,
        generate,
        model,
        profile,
        serve,
    )

    env.register(app)
    model.register(app)
    generate.register(app)
    serve.register(app)
    diagnose.register(app)
    bisect.register(app)
    bench.register(app)
    bench_bw.register(app)
    bench_cpu_moe.register(app)
    bench_serve.register(app)
    bench_decode.register(app)
    bench_llamacpp.register(app)
    bench_probes.register(app)
    profile.register(app)
    demo.register(app)


_register()


def main() -> None:
    app()
