"""`ft serve`: the OpenAI-compatible server over the engine (ft/engine/server.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ft import settings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


def serve(
    model: Annotated[
        str | None,
        typer.Option(help="Model directory (HF layout); default: the built-in tiny one."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = DEFAULT_HOST,
    port: Annotated[
        int,
        typer.Option(min=0, max=65535, help="Port; 0 picks a free one (the ready line names it)."),
    ] = DEFAULT_PORT,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require 'Authorization: Bearer KEY' on /v1/* (default $FT_API_KEY)."),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda if any).")] = None,
    dtype: Annotated[str | None, typer.Option(help="bfloat16, float16 or float32.")] = None,
    moe_strategy: Annotated[str, typer.Option(help="resident or offload.")] = "resident",
    moe_cache_size: Annotated[int | None, typer.Option(help="Expert cache slots.")] = None,
    moe_cache_rate: Annotated[float | None, typer.Option(help="Cache slots / experts.")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Requests decoded at once.")] = 8,
    max_model_len: Annotated[int | None, typer.Option(help="Context length.")] = None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    from ft.engine.config import EngineConfig
    from ft.engine.runner import LLMEngine
    from ft.engine.server import bind_socket, run_server

    sock = bind_socket(host, port)  # before the model loads: a busy port fails at once
    config = EngineConfig(
        model=model, device=device, dtype=dtype, moe_strategy=moe_strategy,
        moe_cache_size=moe_cache_size, moe_cache_rate=moe_cache_rate,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
    )  # fmt: skip
    run_server(LLMEngine(config), sock, api_key=api_key or settings.api_key())


def register(app: typer.Typer) -> None:
    """`ft serve`, and its client `ft bench serve` on the bench group."""
    from ft.cli import bench_serve

    app.command("serve")(serve)
    bench_serve.register()
