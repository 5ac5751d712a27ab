"""`ft serve` black-box: a real server on loopback, the built-in tiny model, max_num_seqs=2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from ft.bench.metrics_text import parse_metrics
from ft.bench.server_process import start_server
from ft.engine.serve.api import ChatMessage, render_chat
from tests.conftest import ft_env, run_ft
from tests.engine.serving import API_KEY, running_server

pytestmark = pytest.mark.timeout(300)

PROMPT = "The expert cache"
# offload with a small cache, so the expert cache counters move; two slots, so aborts matter
ENGINE_FLAGS = ("--moe-strategy", "offload", "--moe-cache-rate", "0.25")
SERVE_FLAGS = (*ENGINE_FLAGS, "--max-num-seqs", "2")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running_server(tmp_path_factory, *SERVE_FLAGS) as pair:
        yield pair


def _stream(client: httpx.Client, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """POST a streaming request; the parsed chunks and the raw `data:` payloads."""
    chunks, raw = [], []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, raw


def _text(chunks: list[dict]) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def _metrics(client: httpx.Client) -> dict[str, float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    return parse_metrics(resp.text)


def test_streamed_text_equals_ft_generate(served, tmp_path_factory):
    _, client = served
    cache = str(tmp_path_factory.getbasetemp() / "ft-cache")
    gen = run_ft("generate", "--prompt", PROMPT, "--max-tokens", "12", "--json", *ENGINE_FLAGS,
                 env=ft_env(FT_CACHE_DIR=cache))  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    expected = json.loads(gen.stdout)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, raw = _stream(client, "/v1/completions", body)
    assert raw[-1] == "[DONE]"
    assert _text(chunks) == expected["text"]
    assert chunks[-1]["choices"] == []  # the usage chunk comes last
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected["token_ids"])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert whole["choices"][0]["text"] == expected["text"]
    assert whole["usage"]["completion_tokens"] == len(expected["token_ids"])


def _engine_thread_ticks(pid: int) -> int:
    """utime + stime (clock ticks) of the server's ft-engine thread, from /proc."""
    tasks = [t for t in Path(f"/proc/{pid}/task").iterdir()]
    engine = [t for t in tasks if (t / "comm").read_text().strip() == "ft-engine"]
    assert len(engine) == 1, [(t / "comm").read_text().strip() for t in tasks]
    fields = (engine[0] / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # stat fields 14 and 15


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_engine_thread_is_named_and_sleeps_when_idle(served):
    server, client = served
    assert client.get("/health").status_code == 200
    before = _engine_thread_ticks(server.proc.pid)
    time.sleep(1.0)
    spent = _engine_thread_ticks(server.proc.pid) - before
    assert spent <= 0.2 * os.sysconf("SC_CLK_TCK")  # a busy-wait would burn the whole second


def test_chat_uses_the_documented_template(served):
    _, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat([ChatMessage(**m) for m in messages])
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    plain = client.post("/v1/completions", json={"prompt": prompt, **sampling})
    chunks, _ = _stream(client, "/v1/chat/completions", {"messages": messages, **sampling})
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _text(chunks) == plain.json()["choices"][0]["text"]
    whole = client.post("/v1/chat/completions", json={"messages": messages, **sampling})
    assert whole.json()["choices"][0]["message"]["content"] == _text(chunks)


def test_eight_concurrent_streams_complete(served):
    server, client = served
    prompts = [f"Stream number {i} asks about experts" for i in range(8)]
    common = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    alone = [client.post("/v1/completions", json={"prompt": p, **common}).json() for p in prompts]

    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[str, int, str]:
        body = {"prompt": prompt, "stream": True, **common}
        body["stream_options"] = {"include_usage": True}
        chunks = []
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        reason = chunks[-2]["choices"][0]["finish_reason"]
        return _text(chunks), chunks[-1]["usage"]["completion_tokens"], reason

    async def all_at_once():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120,
                                     trust_env=False) as http:  # fmt: skip
            return await asyncio.gather(*(one(http, p) for p in prompts))

    results = asyncio.run(all_at_once())
    for (text, n_tokens, reason), single in zip(results, alone, strict=True):
        assert (n_tokens, reason) == (8, "length")
        assert text == single["choices"][0]["text"]  # batching does not change greedy output


def test_disconnect_frees_the_slot(served):
    _, client = served
    before = _metrics(client)
    long = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
    for _ in range(2):  # fill both slots (max_num_seqs=2), read a little, hang up
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        client.post("/v1/completions", json=long, timeout=0.5)
    short = client.post("/v1/completions", json={**long, "max_tokens": 4})
    assert short.status_code == 200
    assert short.json()["usage"]["completion_tokens"] == 4
    after = _wait_idle(client)
    aborted = after.get("ft_requests_finished_total", 0) - before.get(
        "ft_requests_finished_total", 0
    )
    made = after["ft_generation_tokens_total"] - before["ft_generation_tokens_total"]
    assert aborted >= 4  # three aborts and the short request
    assert made < 2 * long["max_tokens"]  # the requests given up stopped early
    assert after["ft_requests_running"] == 0 and after["ft_requests_waiting"] == 0


def _wait_idle(client: httpx.Client, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = _metrics(client)
        idle = values["ft_requests_running"] == 0 and values["ft_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", ', 400),  # malformed JSON
    ("/v1/completions", b"[1, 2]", 400),  # not an object
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "x", "max_tokens": "16"}, 400),  # wrong type
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),  # no prompt
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000_000}, 400),  # past the context
    ("/v1/completions", {"prompt": "word " * 20_000, "max_tokens": 1}, 400),  # prompt too long
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400),  # token id out of the vocabulary
    ("/v1/completions", {"prompt": "x", "temperature": -1.0}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400),  # not done: refused, not ignored
    ("/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/no-such-route", {}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS)
def test_bad_request_gets_openai_error(served, path, body, status):
    _, client = served
    if isinstance(body, bytes):
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_still_healthy_after_bad_requests(served):
    _, client = served
    for path, body, _status in BAD_REQUESTS:
        client.post(path, json=body) if isinstance(body, dict) else client.post(path, content=body)
    assert client.get("/health").status_code == 200
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 3


def test_api_key_is_enforced(served):
    server, _ = served
    body = {"prompt": PROMPT, "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as anon:
        assert anon.post("/v1/completions", json=body).status_code == 401
        assert anon.get("/v1/models").status_code == 401
        wrong = anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert anon.get("/health").status_code == 200  # probes need no key
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert anon.post("/v1/completions", json=body, headers=good).status_code == 200
        models = anon.get("/v1/models", headers=good).json()
    assert models["data"][0]["object"] == "model"


def test_metrics_move_as_tokens_are_made(served):
    _, client = served
    before = _metrics(client)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    after = _metrics(client)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["ft_generation_tokens_total"] == 5
    assert delta["ft_decode_tokens_total"] >= 4  # the first token comes from the prefill
    assert delta["ft_decode_time_seconds_total"] > 0
    assert delta["ft_prefill_tokens_total"] > 0
    assert delta["ft_time_to_first_token_seconds_count"] == 1
    assert after["ft_decode_tokens_per_second"] > 0
    assert delta["ft_expert_cache_hits_total"] + delta["ft_expert_cache_misses_total"] > 0
    assert delta["ft_experts_fetched_total"] > 0  # offload with a quarter of the experts cached
    assert after["ft_experts_fetched_per_step"] > 0
    for name in ("ft_requests_running", "ft_requests_waiting", "ft_experts_fetched_total",
                 "ft_experts_cpu_total", "ft_experts_cpu_inline_total"):  # fmt: skip
        assert name in after


def test_stop_strings_end_the_text_before_them(served):
    _, client = served
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    greedy = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    k = next(
        k for k in range(2, len(greedy) - 2)
        if "\ufffd" not in greedy[k : k + 2] and greedy.find(greedy[k : k + 2]) == k
    )  # fmt: skip
    stop = greedy[k : k + 2]
    whole = client.post("/v1/completions", json={**body, "stop": [stop, "never-seen"]}).json()
    assert whole["choices"][0] == {
        **whole["choices"][0],
        "text": greedy[:k],
        "finish_reason": "stop",
    }
    chunks, raw = _stream(client, "/v1/completions", {**body, "stop": stop})
    assert _text(chunks) == greedy[:k] and raw[-1] == "[DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.timeout(120)
def test_serve_on_a_busy_port_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = run_ft("serve", "--port", str(busy.getsockname()[1]), timeout=60)
    assert out.returncode == 1
    assert (
        out.stderr.startswith("error: cannot listen on 127.0.0.1:")
        and "Traceback" not in out.stderr
    )


@pytest.mark.timeout(300)
def test_sigint_ends_open_streams_and_exits_cleanly(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "ft-cache"
    log_path = tmp_path_factory.mktemp("sigint") / "serve.log"
    server = start_server(["--host", "127.0.0.1"], env=ft_env(FT_CACHE_DIR=str(cache)),
                          log_path=log_path, timeout_s=180)  # fmt: skip
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGINT)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(60) == 0, server.log_tail()
        assert "Shutting down" in server.log_tail()
    finally:
        server.stop()
