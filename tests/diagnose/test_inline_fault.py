"""The seed's symptom on the real engine: `--cpu-moe-inline` (fault injection) makes hybrid's CPU
expert work run on the engine thread; `ft diagnose` must name that thread, its inline frames and
the idle pool, and say nothing of the kind without the fault."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ft


def _diagnose(tmp_path, name: str, *extra: str) -> tuple[dict, str]:
    from ft.demo.prepare import demo_model

    model = demo_model(lambda *a, **k: None)  # experts big enough for the CPU work to show
    # 256 tokens: ~50 stack samples of the engine thread. At 96 (~20 samples, ~1.4 s) the
    # inline frames were in 1-5 of them, and in none in about one run of twelve
    out = tmp_path / name
    proc = run_ft(
        "diagnose", "--strategy", "hybrid", "--model", str(model), "--prompts", "4",
        "--max-tokens", "256", "--interval", "0.05", "--stack-source", "agent", "--out", str(out),
        "--moe-hybrid-max-fetch", "0", "--moe-cache-size", "8", "--dtype", "bfloat16",
        *extra, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "report.json").read_text()), (out / "stacks.collapsed").read_text()


def _why(report: dict, stacks: str) -> str:
    """What a failure needs to be read without a rerun: the sampling, and every thread seen."""
    threads = sorted({line.split(";")[1] for line in stacks.splitlines() if ";" in line})
    return f"run {report['run']}, sampling {report['sampling']}, stack threads {threads}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inline_fault_names_the_engine_thread_its_frames_and_the_idle_pool(tmp_path):
    report, stacks = _diagnose(tmp_path, "fault", "--cpu-moe-inline")
    ids = [f["id"] for f in report["findings"]]
    assert "hot-thread" in ids and "cpu-pool-idle" in ids, ids
    hot = report["findings"][ids.index("hot-thread")]
    assert "ft-engine" in hot["title"]
    engine_stacks = [line for line in stacks.splitlines() if "ft-engine" in line]
    assert any("_run_inline" in line for line in engine_stacks), _why(report, stacks)

    report, stacks = _diagnose(tmp_path, "clean")
    ids = [f["id"] for f in report["findings"]]
    assert "hot-thread" not in ids and "cpu-pool-idle" not in ids, ids
    assert "_run_inline" not in stacks
