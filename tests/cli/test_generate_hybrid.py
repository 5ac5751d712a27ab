"""`ft generate --moe-strategy auto|hybrid` as a user runs it: the startup lines, in
docs/engine.md's order and words, and the inline fault the diagnose drills use."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT, ft_env, run_ft

SEED = REPO_ROOT / "profiles" / "seed-epyc7302-rtxpro4000-gen3.json"


def generate(model_dir, *flags: str, env=None):
    proc = run_ft("generate", "--model", str(model_dir), "--prompt-ids", "5,9,13,40,2",
                  "--max-tokens", "6", "--ignore-eos", "--json", "--cpu-moe-threads", "1",
                  *flags, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr  # the --json line


@pytest.mark.timeout(180)
def test_auto_hybrid_startup_lines_in_order(synth_tiny):
    model_dir, _ = synth_tiny
    result, stderr = generate(
        model_dir, "--moe-strategy", "auto", "--gpu-memory-limit", "0.5",
        "--moe-cache-rate", "0.25", "--bw-profile", str(SEED),
    )  # fmt: skip
    k = json.loads(SEED.read_text())["dtype_kernels"]["bf16"]
    fraction = k["pcie_gather_overlap_gbs"] / (
        k["pcie_gather_overlap_gbs"] + k["cpu_moe_overlap_gbs"]
    )
    expected = [
        f"--moe-strategy auto resolved hybrid (bandwidth profile {SEED}: bf16 ratio",
        "Resolved config: moe_strategy='hybrid', expert_format='bf16', device='cpu'",
        "Free memory before loading model: 0.50 GiB",
        "MoE experts: bf16 via torch",
        f"--moe-hybrid-max-fetch auto: fetching {fraction:.1%} of each decode step's expert"
        " misses over PCIe (benched PCIe/CPU bandwidth ratio), the rest on the CPU",
        "torch intra-op threads: ",
        "CPU MoE executor ready: threads=1 (pinned to cores ",
        "Allocating ",
    ]
    positions = [stderr.find(line) for line in expected]
    assert all(p >= 0 for p in positions), stderr
    assert positions == sorted(positions), stderr
    assert "fmt=bf16 H=64 I=32 experts=16 layers=2 top_k=4" in stderr
    assert result["moe_strategy"] == "hybrid" and result["experts_cpu"] > 0
    assert result["experts_cpu_inline"] == 0 and "outside the pool" not in stderr
    assert result["cache_hits"] + result["cache_misses"] == result["expert_uses"]


@pytest.mark.timeout(180)
def test_inline_fault_from_the_environment_is_counted_and_warned_once(synth_tiny):
    model_dir, _ = synth_tiny
    result, stderr = generate(
        model_dir, "--moe-strategy", "hybrid", "--moe-cache-size", "4",
        "--moe-hybrid-max-fetch", "0", env=ft_env(FT_CPU_MOE_INLINE="1"),
    )  # fmt: skip
    assert "cpu_moe_inline=True" in stderr
    assert stderr.count("computed outside the pool, on thread 'MainThread'") == 1
    assert result["experts_cpu"] == 0 and result["experts_cpu_inline"] > 0
