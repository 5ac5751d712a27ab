"""`ft serve`: an OpenAI-compatible HTTP server over LLMEngine (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then `data: [DONE]`)
    GET  /v1/models, /health, /metrics

The engine runs on its own thread (serve_worker.EngineWorker); the handlers here only turn
HTTP into RequestHandles and engine events back into OpenAI bodies. Errors are OpenAI-shaped:
{"error": {"message", "type", "param", "code"}} with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers

from ft.engine.serve_api import (
    ChatRequest,
    CompletionRequest,
    Detokenizer,
    ResponseShape,
    render_chat,
    usage,
)
from ft.engine.serve_metrics import CONTENT_TYPE, ServerMetrics
from ft.engine.serve_worker import EngineWorker, RequestHandle
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.serve")


class ApiError(Exception):
    """An error answered to the client as OpenAI does; the server carries on."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 500: "server_error"}


def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


async def _parse(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, whatever the content type says (curl -d sends form type)."""
    try:
        data = json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _validation_error(errors: list) -> ApiError:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    if first.get("type") == "missing" and len(loc) == 1:
        return ApiError(400, f"Missing required parameter: '{param}'.", param)
    message = f"Invalid value for '{'.'.join(loc) or 'body'}': {first.get('msg', 'invalid')}."
    return ApiError(400, message, param, "invalid_value")


class _AbortOnClose(StreamingResponse):
    """A stream whose request is aborted whenever it ends early (disconnect, error, cancel)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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


class Service:
    """The routes' state: engine facts, the worker, the metrics and the key."""

    def __init__(self, engine: Any, worker: EngineWorker, metrics: ServerMetrics, api_key=None):
        self.engine, self.worker, self.metrics, self.api_key = engine, worker, metrics, api_key
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        model_config = getattr(engine, "model_config", None)  # the model's vocab may be larger
        self.vocab_size: int = getattr(model_config, "vocab_size", 0) or engine.tokenizer.vocab_size

    def key_error(self, scope) -> JSONResponse | None:
        """401 unless the request carries the key (only /v1/ is guarded, as in vLLM)."""
        if not self.api_key or not scope["path"].startswith("/v1/"):
            return None
        given = Headers(scope=scope).get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if not token:
            return error_response(401, "Missing API key: send 'Authorization: Bearer KEY'.")
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return error_response(401, "Incorrect API key provided.", None, "invalid_api_key")
        return None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            message = f"The model '{name}' does not exist (this server serves '{self.model_name}')."
            raise ApiError(404, message, "model", "model_not_found")

    def prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            return self._encode(render_chat(req.messages))
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "Only one prompt per request is supported.", "prompt")
            prompt = prompt[0]
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ApiError(400, f"Prompt token ids must be in [0, {self.vocab_size}).", "prompt")
        return ids

    def _encode(self, text: str) -> list[int]:
        try:
            return self.engine.tokenizer.encode(text)
        except FtError as exc:  # e.g. a checkpoint without a tokenizer: ids only
            raise ApiError(400, str(exc), "prompt") from None

    def max_tokens(self, req: CompletionRequest | ChatRequest, n_prompt: int) -> int:
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if n_prompt == 0:
            raise ApiError(400, "The prompt is empty.", param)
        room = self.max_model_len - n_prompt
        if room <= 0:
            raise ApiError(400, self._too_long(n_prompt, 0), param, "context_length_exceeded")
        wanted = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            wanted = req.max_completion_tokens
        if wanted is None:
            return room if isinstance(req, ChatRequest) else min(16, room)  # OpenAI's defaults
        if wanted > room:
            message = self._too_long(n_prompt, wanted)
            raise ApiError(400, message, "max_tokens", "context_length_exceeded")
        return wanted

    def _too_long(self, n_prompt: int, n_out: int) -> str:
        return (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {n_prompt + n_out} tokens ({n_prompt} in the prompt, {n_out} for the "
            "completion). Please reduce the prompt or the completion length."
        )


def _sampling_params(req, max_tokens: int):
    from ft.engine.runner import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
    )


async def _generate(svc: Service, request: Request, req, chat: bool) -> Response:
    svc.check_model(req.model)
    ids = svc.prompt_ids(req)
    params = _sampling_params(req, svc.max_tokens(req, len(ids)))
    handle = RequestHandle(ids, params, asyncio.get_running_loop())
    shape = ResponseShape(chat, svc.model_name)
    svc.worker.submit(handle)
    if req.stream:
        body = _stream(svc, handle, shape, req.include_usage)
        return _AbortOnClose(body, lambda: svc.worker.abort(handle), media_type="text/event-stream")
    return await _whole(svc, request, handle, shape)


async def _whole(svc: Service, request: Request, handle: RequestHandle, shape) -> Response:
    """Non-streaming: collect the whole output; abort it if the client goes away first."""
    collect = asyncio.ensure_future(_collect(svc, handle))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
            svc.worker.abort(handle)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    text, reason, n_out, error = collect.result()
    if error is not None:
        return error_response(error[0], error[1])
    return JSONResponse(shape.whole(text, reason, usage(len(handle.prompt_ids), n_out)))


async def _collect(svc: Service, handle: RequestHandle):
    detok, n_out = Detokenizer(svc.engine.tokenizer), 0
    async for event in handle.events():
        if event.error is not None:
            return "", None, 0, (event.error_status, event.error)
        if event.token_id is not None:
            n_out += 1
            detok.push(event.token_id)
        if event.finished:
            detok.push(None, final=True)
            return detok.emitted, event.finish_reason, n_out, None
    return detok.emitted, None, n_out, None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _stream(svc: Service, handle: RequestHandle, shape: ResponseShape, include_usage: bool):
    """One SSE chunk per token (its text delta may be empty), then usage if asked, then [DONE]."""
    detok, n_out, first = Detokenizer(svc.engine.tokenizer), 0, True
    async for event in handle.events():
        if event.error is not None:
            kind = "invalid_request_error" if event.error_status < 500 else "server_error"
            yield _sse(
                {
                    "error": {
                        "message": event.error,
                        "type": kind,
                        "param": None,
                        "code": event.error_status,
                    }
                }
            )
            break
        if event.token_id is not None:
            n_out += 1
        delta = detok.push(event.token_id, final=event.finished)
        if event.token_id is not None or event.finished:
            reason = event.finish_reason if event.finished else None
            chunk = shape.chunk(delta, reason, first=first)
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
            first = False
    if include_usage:
        yield _sse(shape.usage_chunk(usage(len(handle.prompt_ids), n_out)))
    yield "data: [DONE]\n\n"


def build_app(engine: Any, worker: EngineWorker, metrics: ServerMetrics, api_key=None) -> FastAPI:
    svc = Service(engine, worker, metrics, api_key)
    app = FastAPI(title="ft serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc):
        return error_response(404, f"Unknown path: {request.url.path}", None, "not_found")

    @app.exception_handler(405)
    async def _bad_method(request: Request, _exc):
        return error_response(405, f"Method {request.method} not allowed on {request.url.path}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

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
        req = await _parse(request, CompletionRequest)
        return await _generate(svc, request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatRequest)
        return await _generate(svc, request, req, chat=True)

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
