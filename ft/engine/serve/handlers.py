"""The request handlers of `ft serve`: OpenAI bodies in, engine requests out, tokens back.

Errors are OpenAI-shaped, {"error": {"message", "type", "param", "code"}} with a 4xx status;
the checks that can be made before the engine sees a request (model, types, context length)
are made here, so a bad request never reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers

from ft.engine.serve.api import (
    ChatRequest,
    CompletionRequest,
    ResponseShape,
    render_chat,
    usage,
)
from ft.engine.serve.text import TextStream
from ft.engine.serve.worker import EngineWorker, RequestHandle
from ft.errors import FtError


class ApiError(Exception):
    """An error answered to the client as OpenAI does; the server carries on."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_ERROR_TYPES = {401: "authentication_error"}  # else invalid_request_error, 5xx server_error


def error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


async def parse_body(request: Request, model: type[BaseModel]):
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


class Service:
    """The handlers' state: engine facts, the worker and the API key."""

    def __init__(self, engine: Any, worker: EngineWorker, api_key: str | None = None):
        self.engine, self.worker, self.api_key = engine, worker, api_key
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


async def generate(svc: Service, request: Request, req, chat: bool) -> Response:
    svc.check_model(req.model)
    if (field := req.unsupported()) is not None:
        raise ApiError(400, f"'{field}' is not supported by ft serve.", field, "unsupported")
    ids = svc.prompt_ids(req)
    params = _sampling_params(req, svc.max_tokens(req, len(ids)))
    handle = RequestHandle(ids, params, asyncio.get_running_loop())
    shape = ResponseShape(chat, svc.model_name)
    svc.worker.submit(handle)
    if req.stream:
        body = _stream(svc, handle, shape, req)
        return _AbortOnClose(
            body, lambda: svc.worker.abort(handle), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},  # no proxy buffering
        )  # fmt: skip
    return await _whole(svc, request, handle, shape, req.stop_strings)


async def _whole(svc: Service, request: Request, handle: RequestHandle, shape, stops) -> Response:
    """Non-streaming: collect the whole output; abort it if the client goes away first."""
    collect = asyncio.ensure_future(_collect(svc, handle, stops))
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


async def _collect(svc: Service, handle: RequestHandle, stops: list[str]):
    text, n_out = TextStream(svc.engine.tokenizer, stops), 0
    async for event in handle.events():
        if event.error is not None:
            return "", None, 0, (event.error_status, event.error)
        n_out += event.token_id is not None
        text.push(event.token_id, final=event.finished)
        if text.stopped:
            svc.worker.abort(handle)
            return text.sent, "stop", n_out, None
        if event.finished:
            return text.sent, event.finish_reason, n_out, None
    return text.sent, None, n_out, None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _stream(svc: Service, handle: RequestHandle, shape: ResponseShape, req):
    """One SSE chunk per token (its text delta may be empty), then usage if asked, then [DONE]."""
    text, n_out, first = TextStream(svc.engine.tokenizer, req.stop_strings), 0, True
    async for event in handle.events():
        if event.error is not None:
            yield _sse(error_body(event.error_status, event.error))  # after a 200: in band
            break
        n_out += event.token_id is not None
        delta = text.push(event.token_id, final=event.finished)
        reason = "stop" if text.stopped else event.finish_reason if event.finished else None
        if event.token_id is not None or reason is not None:
            chunk = shape.chunk(delta, reason, first=first)
            if req.include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
            first = False
        if text.stopped:
            svc.worker.abort(handle)
            break
    if req.include_usage:
        yield _sse(shape.usage_chunk(usage(len(handle.prompt_ids), n_out)))
    yield "data: [DONE]\n\n"
