"""`ft serve`: the OpenAI-compatible server over the engine (ft/engine/serve/server.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ft import settings
from ft.cli.options import EngineFlags, engine_options

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


@engine_options
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = DEFAULT_HOST,
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help="Port; 0 picks a free one (see ready line)."),
    ] = DEFAULT_PORT,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' on /v1/*."),
    ] = None,
    *,
    engine: EngineFlags,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    import faulthandler

    from ft.engine.runner import LLMEngine
    from ft.engine.serve.server import bind_socket, run_server
    from ft.probes.stacks import start_attach_agent

    # a crash in native code (numba's LLVM, a kernel) leaves every thread's Python stack in the
    # log a service or `ft diagnose` keeps, not a bare "signal 11"
    faulthandler.enable()
    start_attach_agent()  # FT_AGENT_ATTACH (a unit file): stacks for `ft diagnose --pid`
    sock = bind_socket(host, port)  # before the model loads: a busy port fails at once
    try:
        llm = LLMEngine(engine.config())
    except BaseException:
        sock.close()
        raise
    run_server(llm, sock, api_key=api_key or settings.api_key())


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
