"""`ft bench decode` on the tiny model on the CPU: the report's shape and its byte accounting
(no timing assertions), the roofline formula, the peer baseline, and bad flags."""

from __future__ import annotations

import json
import re
import statistics

import pytest
from typer.testing import CliRunner

from ft.bench.roofline import Bandwidths, StepBytes, roofline
from ft.cli.app import app
from tests.test_profile import SEED_PROFILE

STRATEGIES = ("resident", "offload")


def bench(*flags: str) -> dict:
    result = CliRunner().invoke(app, ["bench", "decode", "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.engine.checkpoints import make_synth_tiny

    return make_synth_tiny(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def report(model):
    return bench(
        "--model", str(model), "--strategies", ",".join(STRATEGIES), "--batch", "1,3",
        "--tokens", "5", "--warmup", "1", "--moe-cache-rate", "0.25", "--profile",
        str(SEED_PROFILE),
    )  # fmt: skip


def test_every_strategy_and_batch_has_a_positive_rate_and_a_roofline(report):
    rows = {(r["strategy"], r["batch"]): r for r in report["results"]}
    assert set(rows) == {(s, b) for s in STRATEGIES for b in (1, 3)}
    for row in rows.values():
        assert row["error"] is None and row["steps"] == 5 and row["tok_s"] > 0
        roof = row["roofline"]
        assert roof["tok_s"] > 0 and roof["bound"] in ("hbm", "pcie", "host")
        assert roof["step_s"] == max(roof[f"{link}_s"] or 0 for link in ("hbm", "pcie", "host"))
        assert row["ratio"] == pytest.approx(row["tok_s"] / roof["tok_s"])
    bw = report["bandwidth"]
    assert bw["hbm_gbs"] > 0 and bw["pcie_gbs"] and bw["host_gbs"]  # the seed profile's links


def test_byte_counts_follow_the_engine_counters(report):
    for row in report["results"]:
        step, nbytes = row["per_step"], row["per_step"]["expert_bytes"]
        assert step["cache_hits"] + step["cache_misses"] == pytest.approx(step["expert_uses"])
        # offload's device gates read an expert in place where no slot could be had for it
        crossed = step["experts_fetched"] + step.get("experts_in_place", 0)
        assert step["pcie_bytes"] == pytest.approx(crossed * nbytes)
        assert step["host_bytes"] == 0  # neither strategy computes experts on the CPU
        assert step["hbm_bytes"] > step["expert_uses"] * nbytes  # plus dense weights and KV
    resident = [r for r in report["results"] if r["strategy"] == "resident"]
    assert all(r["per_step"]["pcie_bytes"] == 0 and r["cache_size"] is None for r in resident)
    offload = [r for r in report["results"] if r["strategy"] == "offload"]
    assert sum(r["per_step"]["experts_fetched"] for r in offload) > 0  # a quarter-size cache
    by_batch = {r["batch"]: r["per_step"]["expert_uses"] for r in resident}
    assert by_batch[3] >= by_batch[1]  # more tokens route to at least as many experts


def test_roofline_is_bound_by_the_slowest_link():
    bw = Bandwidths(hbm_gbs=1000.0, pcie_gbs=50.0, host_gbs=None, source={})
    roof = roofline(StepBytes(hbm=1e9, pcie=1e8, host=0.0), bw, tokens_per_step=2)
    assert roof["bound"] == "pcie" and roof["step_s"] == pytest.approx(2e-3)
    assert roof["tok_s"] == pytest.approx(1000.0) and roof["unbounded"] == []
    roof = roofline(StepBytes(hbm=1e9, pcie=0.0, host=5e8), bw, tokens_per_step=1)
    assert roof["bound"] == "hbm" and roof["unbounded"] == ["host"]


@pytest.mark.timeout(300)
def test_peer_accelerate_on_the_cpu(model):
    got = bench("--model", str(model), "--strategies", "resident", "--tokens", "3",
                "--warmup", "1", "--peer", "accelerate")  # fmt: skip
    peer = [r for r in got["results"] if r["strategy"] == "peer:accelerate"]
    assert len(peer) == 1 and peer[0]["error"] is None
    assert peer[0]["tok_s"] > 0 and peer[0]["steps"] == 3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--strategies", "bogus"], "--strategies: bogus"),
        (["--batch", "1,x"], "--batch takes comma-separated integers"),
        (["--batch", "0"], "--batch sizes must be at least 1"),
        (["--peer", "vllm"], "--peer 'vllm'"),
        (["--moe-prefetch-depth", "9"], "moe_prefetch_depth must be 1..4 or auto, got 9"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message):
    result = CliRunner().invoke(app, ["bench", "decode", *flags])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


def test_trace_writes_a_chrome_trace_and_an_op_table(model, tmp_path):
    got = bench("--model", str(model), "--strategies", "offload", "--tokens", "2",
                "--warmup", "0", "--trace", str(tmp_path))  # fmt: skip
    trace = got["results"][0]["trace"]
    assert json.loads(open(trace["trace"]).read())["traceEvents"]
    assert "aten::" in open(trace["ops"]).read()
    assert trace["timeline"] is None  # the device timeline is CUDA-only


@pytest.mark.timeout(300)
def test_hybrid_reports_what_a_cpu_layer_costs_the_host(model):
    from rich.console import Console

    from ft.cli.bench_decode import render, round_trip_line
    from ft.engine.strategies.hybrid import ROUND_TRIP

    report = bench(
        "--model", str(model), "--strategies", "hybrid", "--batch", "1", "--tokens", "4",
        "--warmup", "1", "--moe-cache-rate", "0.25", "--profile", str(SEED_PROFILE),
    )  # fmt: skip
    (row,) = report["results"]
    step = row["per_step"]
    assert 0 < step["cpu_layers"] <= step["experts_cpu"]  # the seed profile fetches 27.8%
    host_us = sum(step[f"cpu_{part}_us"] for part in ROUND_TRIP)
    assert 0 < host_us <= 1e3 * statistics.fmean(row["step_ms"])  # within the step
    console = Console(record=True, width=300)
    render(report, console)
    line = round_trip_line("hybrid b1", step)
    assert line in console.export_text().splitlines()
    assert line.startswith(f"cpu layers hybrid b1: {step['cpu_layers']:.1f} a step, ")
    parts = re.search(r"on the host \((.*)\)", line).group(1).split(", ")
    assert [p.split()[0] for p in parts] == list(ROUND_TRIP)
