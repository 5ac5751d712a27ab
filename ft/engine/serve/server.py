"""`ft serve`: an OpenAI-compatible HTTP server over LLMEngine (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then `data: [DONE]`)
    GET  /v1/models, /health, /metrics

Parts: api (OpenAI request models, chat template, response bodies), text (deltas), handlers
(requests in, tokens back, OpenAI-shaped errors), worker (the engine's own thread, continuous
batching), metrics (/metrics). This module wires them together
and runs uvicorn on a socket bound before the model loads; the ready line is logged once it
listens.
"""

from __future__ import annotations

import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ft.engine.serve.api import ChatRequest, CompletionRequest
from ft.engine.serve.handlers import (
    ApiError,
    Service,
    error_response,
    generate,
    parse_body,
)
from ft.engine.serve.metrics import CONTENT_TYPE, ServerMetrics
from ft.engine.serve.worker import EngineWorker
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.serve")


class _KeyGuard:
    """Pure ASGI middleware (it leaves streaming and disconnects alone): the API key check."""

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc

    async def __call__(self, scope, receive, send):
        refusal = self.svc.key_error(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(engine: Any, worker: EngineWorker, metrics: ServerMetrics, api_key=None) -> FastAPI:
    svc = Service(engine, worker, api_key)
    app = FastAPI(title="ft serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception):
        log.error("request failed", exc_info=exc)  # a server bug: logged, answered, not fatal
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc):
        return error_response(404, f"Unknown path: {request.url.path}", None, "not_found")

    @app.exception_handler(405)
    async def _bad_method(request: Request, _exc):
        return error_response(405, f"Method {request.method} not allowed on {request.url.path}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if worker.is_alive() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": svc.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ft",
            "max_model_len": svc.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest)
        return await generate(svc, request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatRequest)
        return await generate(svc, request, req, chat=True)

    app.add_middleware(_KeyGuard, svc=svc)
    return app


READY_LINE = "API server is ready to serve on {host}:{port}"


class _ReadyServer(uvicorn.Server):
    """uvicorn, plus: the ready line once the socket listens; the engine stopped first on exit."""

    def __init__(self, config: uvicorn.Config, ready_line: str, worker: EngineWorker):
        super().__init__(config)
        self.ready_line, self.worker = ready_line, worker

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            log.info(self.ready_line)

    async def shutdown(self, sockets=None) -> None:
        log.info("Shutting down: aborting the requests in flight")
        self.worker.stop()  # open streams get their final chunk and [DONE] before the close
        await super().shutdown(sockets=sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now (before the model loads, to fail fast); uvicorn listens once the engine is up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FtError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_server(engine: Any, sock: socket.socket, api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM; then stop the engine thread and close the engine."""
    host, port = sock.getsockname()[:2]
    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics)
    metrics.attach(worker)
    app = build_app(engine, worker, metrics, api_key)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = _ReadyServer(config, READY_LINE.format(host=host, port=port), worker)
    worker.start()
    # uvicorn re-raises the signal it caught once it has shut down; with these no-op handlers
    # in place that re-raise is harmless, so the cleanup below runs and the exit status is 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        engine.close()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
