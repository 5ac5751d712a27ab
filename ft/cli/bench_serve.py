"""`ft bench serve`: stream the seeded workload through an OpenAI-compatible server."""

from __future__ import annotations

import json
import shlex
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ft import settings
from ft.bench.server_process import start_server
from ft.bench.workload import WorkloadResult, run_workload
from ft.cli.bench import bench_app
from ft.errors import FtError


def bench_serve(
    url: Annotated[
        str | None, typer.Option(help="A running server (http://HOST:PORT); else one is started.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model directory for the server started here (no --url).")
    ] = None,
    prompts: Annotated[int, typer.Option(min=1, help="Requests to send (fixed, seeded).")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to decode per request.")] = 64,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the prompt set.")] = 0,
    api_key: Annotated[
        str | None, typer.Option(help="Bearer key for the server (default $FT_API_KEY).")
    ] = None,
    serve_args: Annotated[
        str, typer.Option(help="Extra `ft serve` flags for the server started here, quoted.")
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decode tok/s end to end (every streamed delta) beside the engine's own, and TTFT."""
    if url and (model or serve_args):
        raise FtError("--model and --serve-args start a server; they do not go with --url")
    api_key = api_key or settings.api_key()
    args = dict(prompts=prompts, max_tokens=max_tokens, concurrency=concurrency, seed=seed)
    if url:
        result = run_workload(url, api_key=api_key, **args)
    else:
        flags = (["--model", model] if model else []) + shlex.split(serve_args)
        if api_key:
            flags += ["--api-key", api_key]
        with start_server(flags) as server:
            result = run_workload(server.url, api_key=api_key, **args)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _render(result)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _render(res: WorkloadResult) -> None:
    table = Table(title=f"ft bench serve: {res.model} at {res.base_url}")
    for column in ("request", "tokens", "TTFT s", "decode tok/s (e2e)", "finish", "error"):
        table.add_column(column, justify="right" if column != "error" else "left")
    for r in res.requests:
        table.add_row(
            str(r.index), str(r.tokens), _fmt(r.ttft_s, 3), _fmt(r.e2e_decode_tok_s),
            r.finish_reason or "-", r.error or "",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"decode (end-to-end, every streamed delta): {_fmt(res.e2e_decode_tok_s)} tok/s   "
        f"engine-reported decode: {_fmt(res.engine_decode_tok_s)} tok/s   "
        f"median TTFT: {_fmt(res.ttft_s, 3)} s   throughput: {_fmt(res.throughput_tok_s)} tok/s   "
        f"({res.prompts} prompts x {res.max_tokens} tokens, concurrency {res.concurrency}, "
        f"ignore_eos={res.ignore_eos}, errors {res.errors})"
    )


def register() -> None:
    bench_app.command("serve")(bench_serve)
