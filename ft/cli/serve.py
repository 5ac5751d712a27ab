"""`ft serve`: the OpenAI-compatible server over the engine (ft/engine/server.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ft import settings
from ft.cli.options import (
    CacheAutoOpt,
    CacheRateOpt,
    CacheSizeOpt,
    DeviceOpt,
    DtypeOpt,
    GpuMemoryOpt,
    KvReserveOpt,
    MaxModelLenOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    StrategyOpt,
    engine_config_from_options,
)  # fmt: skip

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = DEFAULT_HOST,
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help="Port; 0 picks a free one (see ready line)."),
    ] = DEFAULT_PORT,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' on /v1/*."),
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    moe_strategy: StrategyOpt = "resident",
    moe_cache_size: CacheSizeOpt = None,
    moe_cache_rate: CacheRateOpt = None,
    moe_cache_auto: CacheAutoOpt = False,
    kv_reserve_tokens: KvReserveOpt = None,
    gpu_memory_limit: GpuMemoryOpt = None,
    max_num_seqs: MaxNumSeqsOpt = 8,
    max_model_len: MaxModelLenOpt = None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    from ft.engine.runner import LLMEngine
    from ft.engine.server import bind_socket, run_server

    sock = bind_socket(host, port)  # before the model loads: a busy port fails at once
    try:
        config = engine_config_from_options(
            model, device, dtype, moe_strategy, moe_cache_size, moe_cache_rate, moe_cache_auto,
            kv_reserve_tokens, gpu_memory_limit, max_num_seqs, max_model_len,
        )  # fmt: skip
        engine = LLMEngine(config)
    except BaseException:
        sock.close()
        raise
    run_server(engine, sock, api_key=api_key or settings.api_key())


def register(app: typer.Typer) -> None:
    """`ft serve`, and its client `ft bench serve` on the bench group."""
    from ft.cli import bench_serve

    app.command("serve")(serve)
    bench_serve.register()
