"""The workload client against a real `ft serve`, and its pure parts."""

from __future__ import annotations

import json

import pytest

from ft.bench.metrics_text import counter_deltas, parse_metrics
from ft.bench.workload import make_prompts, run_workload
from ft.errors import FtError
from tests.conftest import ft_env, run_ft
from tests.engine.serving import API_KEY, running_server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running_server(tmp_path_factory, "--max-num-seqs", "4") as pair:
        yield pair


@pytest.mark.timeout(300)
def test_workload_numbers_are_positive_and_consistent(served):
    server, _ = served
    res = run_workload(server.url, prompts=3, max_tokens=8, concurrency=2, api_key=API_KEY)
    assert res.ignore_eos and res.errors == 0 and len(res.requests) == 3
    for r in res.requests:
        assert r.tokens == 8 and r.deltas == 8 and r.finish_reason == "length"
        assert r.prompt_tokens > 0
        assert r.ttft_s > 0 and r.decode_s > 0 and r.e2e_decode_tok_s > 0
        assert r.e2e_decode_tok_s == pytest.approx(7 / r.decode_s)
        assert r.latency_s >= r.ttft_s + r.decode_s
    assert res.e2e_decode_tok_s > 0 and res.ttft_s > 0 and res.throughput_tok_s > 0
    assert res.engine_decode_tok_s > 0
    assert res.engine_counters["ft_generation_tokens_total"] == 24  # the warm-up is not counted
    assert res.engine_counters["ft_decode_tokens_total"] >= 3 * 7
    spans = sum(r.decode_s for r in res.requests)
    assert res.e2e_decode_tok_s == pytest.approx(21 / spans)


@pytest.mark.timeout(300)
def test_bench_serve_cli_json(served, tmp_path_factory):
    server, _ = served
    cache = str(tmp_path_factory.getbasetemp() / "ft-cache")
    args = ("bench", "serve", "--url", server.url, "--prompts", "2", "--max-tokens", "5")
    out = run_ft(*args, "--api-key", API_KEY, "--json", env=ft_env(FT_CACHE_DIR=cache))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["tokens"] for r in data["requests"]] == [5, 5]
    assert data["e2e_decode_tok_s"] > 0 and data["engine_decode_tok_s"] > 0
    table = run_ft(*args, "--api-key", API_KEY, env=ft_env(FT_CACHE_DIR=cache))
    assert table.returncode == 0, table.stderr
    assert "every streamed delta" in table.stdout


@pytest.mark.timeout(300)
def test_bench_serve_reports_a_wrong_key_in_one_line(served):
    server, _ = served
    out = run_ft("bench", "serve", "--url", server.url, "--api-key", "wrong", "--prompts", "1")
    assert out.returncode == 1
    assert out.stderr.startswith("error:") and "401" in out.stderr
    assert "Traceback" not in out.stderr


def test_workload_needs_a_server():
    with pytest.raises(FtError, match="cannot reach"):
        run_workload("http://127.0.0.1:9", prompts=1, max_tokens=1)


def test_prompts_are_fixed_by_seed():
    assert make_prompts(4, seed=1) == make_prompts(4, seed=1)
    assert make_prompts(4, seed=1) != make_prompts(4, seed=2)
    assert len(set(make_prompts(8))) == 8


def test_counter_deltas_from_prometheus_text():
    before = parse_metrics("# TYPE ft_decode_tokens counter\nft_decode_tokens_total 10\n")
    after = parse_metrics(
        "# TYPE ft_decode_tokens counter\nft_decode_tokens_total 25\n"
        "# TYPE ft_requests_finished counter\n"
        'ft_requests_finished_total{finish_reason="stop"} 2\n'
        'ft_requests_finished_total{finish_reason="abort"} 1\n'
        "# TYPE ft_requests_running gauge\nft_requests_running 1\n"
    )
    deltas = counter_deltas(before, after)
    assert deltas == {"ft_decode_tokens_total": 15, "ft_requests_finished_total": 3}


def _plain_openai_app():
    """A minimal OpenAI-style server: no ignore_eos, no usage, no /metrics (like many are)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(_request):
        return JSONResponse({"object": "list", "data": [{"id": "plain", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        if "ignore_eos" in body:
            error = {"message": "Unrecognized request argument supplied: ignore_eos"}
            return JSONResponse({"error": error}, status_code=400)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "xx", "finish_reason": "length"}]})

        async def chunks():
            for _ in range(body["max_tokens"]):
                yield 'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes)


@pytest.fixture
def plain_server():
    import threading
    import time

    import uvicorn

    config = uvicorn.Config(_plain_openai_app(), host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.timeout(60)
def test_workload_works_with_a_plain_openai_server(plain_server):
    res = run_workload(plain_server, prompts=2, max_tokens=5, concurrency=2)
    assert res.model == "plain" and not res.ignore_eos
    assert [r.tokens for r in res.requests] == [5, 5]  # counted from the deltas
    assert res.e2e_decode_tok_s > 0
    assert res.engine_decode_tok_s is None and res.engine_counters == {}


@pytest.mark.timeout(300)
def test_bench_serve_starts_and_stops_its_own_server(tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "ft-cache")
    args = ("bench", "serve", "--prompts", "2", "--max-tokens", "4", "--json")
    out = run_ft(*args, "--serve-args", "--max-num-seqs 1", env=ft_env(FT_CACHE_DIR=cache))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["tokens"] for r in data["requests"]] == [4, 4]
    assert data["base_url"].startswith("http://127.0.0.1:")
