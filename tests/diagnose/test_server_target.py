"""Engine mode's plumbing on a stand-in server: ready line, workload, throughput, strategy."""

import json
import sys
import time
from types import SimpleNamespace

import pytest

from ft.diagnose.compare import write_comparison
from ft.diagnose.runner import DiagnoseConfig, diagnose
from ft.diagnose.server_target import ServerTarget, WorkloadSpec
from tests.conftest import REPO_ROOT, run_ft

pytestmark = pytest.mark.timeout(120)
FAKE = [sys.executable, str(REPO_ROOT / "tests/assets/fake_serve.py")]


def fake_workload(url: str, spec: WorkloadSpec):
    assert url.startswith("http://127.0.0.1:")
    time.sleep(2.5)  # while the probes sample the server
    counters = {"ft_experts_to_cpu_total": 12.0, "ft_ttft_seconds_sum": 1.0}  # the client's deltas
    return SimpleNamespace(e2e_decode_tok_s=0.5, ttft_s=1.0, engine_decode_tok_s=0.5,
                           throughput_tok_s=0.5, engine_counters=counters)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("engine")
    return {s: run(base, s) for s in ("hybrid", "offload")}


def run(tmp_path, strategy: str) -> dict:
    out = tmp_path / strategy
    target = ServerTarget(strategy, [], out / "target.log", WorkloadSpec(), FAKE, fake_workload)
    config = DiagnoseConfig(out, duration=30, interval=0.25, stack_source="agent")
    outcome, report = diagnose(target, config)
    assert outcome.stopped_by == "finished"
    return report


def test_hybrid_with_the_inline_fault_names_the_engine_thread(runs):
    report = runs["hybrid"]
    ids = [f["id"] for f in report["findings"]]
    assert ids[:2] == ["hot-thread", "cpu-pool-idle"]
    assert "inline_expert_ffn" in report["findings"][0]["title"]
    assert report["context"]["strategy"] == "hybrid" and report["context"]["workload"] is True
    assert report["throughput"]["e2e_decode_tok_s"] == 0.5
    assert report["throughput"]["counters"] == {"experts_to_cpu": 12.0}
    assert "CPU MoE executor ready" in "\n".join(report["startup"])


def test_offload_without_the_fault_has_no_such_finding(runs):
    assert [f["id"] for f in runs["offload"]["findings"]] == []
    assert runs["offload"]["context"]["expects_cpu_pool"] is False


def test_side_by_side(tmp_path, runs):
    md = write_comparison(tmp_path, runs)
    hybrid, offload = (
        line for line in md.splitlines() if line.startswith(("| hybrid", "| offload"))
    )
    assert "hot-thread" in hybrid and "hot-thread" not in offload
    assert "MainThread" in hybrid and "[report](hybrid/report.md)" in hybrid


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_mode_on_the_real_server_side_by_side(tmp_path):
    out = tmp_path / "report"
    # a workload of several sampling intervals even where resident decodes the tiny model at
    # 400+ tok/s (2 prompts of 16 tokens took 0.07 s on a Zen 5 box: no thread sample in it)
    args = ["diagnose", "--strategy", "offload", "--vs", "resident", "--prompts", "4",
            "--max-tokens", "64", "--interval", "0.05", "--stack-source", "agent",
            "--out", str(out)]  # fmt: skip
    proc = run_ft(*args)
    assert proc.returncode == 0, proc.stderr
    for strategy in ("offload", "resident"):
        report = json.loads((out / strategy / "report.json").read_text())
        assert report["run"]["stopped_by"] == "finished" and report["run"]["window"] == "workload"
        assert report["context"]["strategy"] == strategy
        assert report["throughput"]["e2e_decode_tok_s"] > 0
        assert report["throughput"]["counters"]["decode_tokens"] > 0  # the engine's, by short name
        assert "ft-engine" in {t["name"] for t in report["threads"] if t["role"] == "engine"}
        assert "hot-thread" not in [f["id"] for f in report["findings"]]
    md = (out / "report.md").read_text()
    assert "| offload |" in md and "| resident |" in md
