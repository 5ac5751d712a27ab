"""The workload client: N fixed, seeded prompts streamed through any OpenAI-compatible server.

Used by `ft bench serve`, `ft diagnose` and `ft bisect`. Per request it records the arrival
time of every streamed delta; the figures are the seed report's:

    end-to-end decode tok/s = (tokens - 1) / (last delta - first delta)    per request;
                              overall: sum of (tokens - 1) / sum of those spans
    TTFT                    = first delta - request sent                    (median overall)
    engine decode tok/s     = d(ft_decode_tokens_total) / d(ft_decode_time_seconds_total)
                              from /metrics before and after the run (None if not exposed)
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from socket import IPPROTO_TCP, TCP_NODELAY
from urllib.parse import urlparse

import httpx

from ft.bench.metrics_text import counter_deltas, scrape
from ft.errors import FtError

_WORDS = (
    "expert cache router token decode prefill layer tensor memory bandwidth offload hybrid "
    "resident pinned host device stream kernel batch sequence attention rotary norm gate "
    "weight shard slot eviction miss hit fetch copy thread pool core queue latency throughput"
).split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """N prompts of 12-24 words, the same for the same (n, seed) on every version of ft."""
    rng = random.Random(seed)
    return [
        f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(12, 24)))
        for i in range(n)
    ]


@dataclass(frozen=True)
class RequestResult:
    index: int
    prompt_tokens: int | None  # the server's usage count, where it sends one
    tokens: int  # completion tokens: the server's usage count, else the number of deltas
    deltas: int  # streamed chunks that carried a choice
    ttft_s: float | None
    decode_s: float | None  # first delta to last delta
    e2e_decode_tok_s: float | None
    latency_s: float
    finish_reason: str | None
    text: str
    error: str | None = None


@dataclass(frozen=True)
class WorkloadResult:
    base_url: str
    model: str
    prompts: int
    max_tokens: int
    concurrency: int
    seed: int
    ignore_eos: bool
    requests: list[RequestResult]
    e2e_decode_tok_s: float | None
    ttft_s: float | None  # median over requests
    engine_decode_tok_s: float | None
    throughput_tok_s: float  # all completion tokens / wall time of the run
    wall_s: float
    engine_counters: dict[str, float] = field(default_factory=dict)  # /metrics deltas
    errors: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Client:
    http: httpx.AsyncClient
    model: str
    max_tokens: int
    ignore_eos: bool


def run_workload(
    base_url: str,
    prompts: int = 4,
    max_tokens: int = 64,
    concurrency: int = 1,
    seed: int = 0,
    api_key: str | None = None,
    model: str | None = None,
    ignore_eos: bool | None = None,
    timeout_s: float = 600.0,
) -> WorkloadResult:
    """Stream `prompts` seeded prompts, `concurrency` at a time; ignore_eos None = if accepted."""
    if prompts < 1 or max_tokens < 1 or concurrency < 1:
        raise FtError("prompts, max tokens and concurrency must each be at least 1")
    args = (base_url.rstrip("/"), prompts, max_tokens, concurrency, seed)
    return asyncio.run(_run(*args, api_key, model, ignore_eos, timeout_s))


async def _run(base, n, max_tokens, concurrency, seed, api_key, model, ignore_eos, timeout_s):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    local = urlparse(base).hostname in ("127.0.0.1", "localhost", "::1")
    # no Nagle: a small request write must not wait on the server's delayed ACK
    transport = httpx.AsyncHTTPTransport(socket_options=[(IPPROTO_TCP, TCP_NODELAY, 1)])
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=timeout, trust_env=not local, transport=transport
    ) as http:
        model = model or await _first_model(http)
        if ignore_eos is None:
            ignore_eos = await _accepts_ignore_eos(http, model)
        client = _Client(http, model, max_tokens, ignore_eos)
        before = await scrape(http)
        started = time.perf_counter()
        results = await _run_all(client, make_prompts(n, seed), concurrency)
        wall = time.perf_counter() - started
        after = await scrape(http)
    return _summarise(base, client, seed, concurrency, results, wall, before, after)


async def _first_model(http: httpx.AsyncClient) -> str:
    try:
        resp = await http.get("/v1/models")
    except httpx.HTTPError as exc:
        raise FtError(f"cannot reach the server at {http.base_url}: {exc}") from None
    if resp.status_code != 200:
        raise FtError(f"GET /v1/models answered {resp.status_code}: {_error_text(resp.text)}")
    data = resp.json().get("data") or []
    if not data:
        raise FtError("the server lists no model in /v1/models")
    return data[0]["id"]


async def _accepts_ignore_eos(http: httpx.AsyncClient, model: str) -> bool:
    """A two-token warm-up with ignore_eos; a 4xx naming it means this server does not take it."""
    body = {"model": model, "prompt": "warm up", "max_tokens": 2, "temperature": 0.0}
    try:
        resp = await http.post("/v1/completions", json={**body, "ignore_eos": True})
        if resp.status_code == 200:
            return True
        if 400 <= resp.status_code < 500 and "ignore_eos" in resp.text:
            resp = await http.post("/v1/completions", json=body)
            if resp.status_code == 200:
                return False
    except httpx.HTTPError as exc:
        raise FtError(f"warm-up request failed: {type(exc).__name__}: {exc}") from None
    raise FtError(f"warm-up request answered {resp.status_code}: {_error_text(resp.text)}")


async def _run_all(client: _Client, prompts: list[str], concurrency: int) -> list[RequestResult]:
    todo: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        todo.put_nowait(item)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not todo.empty():
            index, prompt = todo.get_nowait()
            results.append(await _one(client, index, prompt))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return sorted(results, key=lambda r: r.index)


async def _one(client: _Client, index: int, prompt: str) -> RequestResult:
    body = {
        "model": client.model,
        "prompt": prompt,
        "max_tokens": client.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if client.ignore_eos:
        body["ignore_eos"] = True
    stamps: list[float] = []
    pieces: list[str] = []
    state: dict = {"usage": None, "finish": None, "error": None}
    sent = time.perf_counter()
    try:
        async with client.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                state["error"] = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
            else:
                async for line in resp.aiter_lines():
                    if _take(line, state, stamps, pieces):
                        break
    except httpx.HTTPError as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # a `data:` line that is not JSON
        state["error"] = f"malformed stream chunk: {exc}"
    if not stamps and state["error"] is None:
        state["error"] = "the server streamed no deltas"
    return _request_result(index, sent, stamps, pieces, state)


def _take(line: str, state: dict, stamps: list[float], pieces: list[str]) -> bool:
    """Record one SSE line; True at `data: [DONE]`."""
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        return True
    chunk = json.loads(payload)
    if "error" in chunk:
        state["error"] = _error_text(json.dumps(chunk))
        return True
    state["usage"] = chunk.get("usage") or state["usage"]
    for choice in chunk.get("choices") or []:
        stamps.append(time.perf_counter())
        delta = choice.get("delta") or {}
        pieces.append(choice.get("text") or delta.get("content") or "")
        state["finish"] = choice.get("finish_reason") or state["finish"]
    return False


def _request_result(index, sent, stamps, pieces, state) -> RequestResult:
    usage = state["usage"] or {}
    tokens = int(usage.get("completion_tokens") or len(stamps))
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else None
    rate = (tokens - 1) / span if span and tokens > 1 else None
    return RequestResult(
        index=index,
        prompt_tokens=usage.get("prompt_tokens"),
        tokens=tokens,
        deltas=len(stamps),
        ttft_s=stamps[0] - sent if stamps else None,
        decode_s=span,
        e2e_decode_tok_s=rate,
        latency_s=time.perf_counter() - sent,
        finish_reason=state["finish"],
        text="".join(pieces),
        error=state["error"],
    )


def _summarise(base, client, seed, concurrency, results, wall, before, after) -> WorkloadResult:
    ok = [r for r in results if r.error is None]
    if not ok:
        raise FtError(f"every request failed; the first: {results[0].error}")
    spans = [(r.tokens - 1, r.decode_s) for r in ok if r.decode_s]
    span_s = sum(s for _, s in spans)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    deltas = counter_deltas(before, after)
    return WorkloadResult(
        base_url=base,
        model=client.model,
        prompts=len(results),
        max_tokens=client.max_tokens,
        concurrency=concurrency,
        seed=seed,
        ignore_eos=client.ignore_eos,
        requests=results,
        e2e_decode_tok_s=sum(t for t, _ in spans) / span_s if span_s else None,
        ttft_s=statistics.median(ttfts) if ttfts else None,
        engine_decode_tok_s=_engine_rate(deltas),
        throughput_tok_s=sum(r.tokens for r in ok) / wall if wall > 0 else 0.0,
        wall_s=wall,
        engine_counters=deltas,
        errors=len(results) - len(ok),
    )


def _engine_rate(deltas: dict[str, float]) -> float | None:
    tokens = deltas.get("ft_decode_tokens_total")
    seconds = deltas.get("ft_decode_time_seconds_total")
    return tokens / seconds if tokens and seconds else None


def _error_text(body: bytes | str) -> str:
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:300]
