"""`--moe-strategy auto` and `--moe-hybrid-max-fetch auto`: what they resolve to, and the line
that says why, from memory and the bandwidth profile (the seed's box among the references)."""

from __future__ import annotations

import json
import logging

import pytest

from ft.engine.config import EngineConfig
from ft.engine.runner import LLMEngine
from tests.conftest import REPO_ROOT

SEED = REPO_ROOT / "profiles" / "seed-epyc7302-rtxpro4000-gen3.json"
H200 = REPO_ROOT / "profiles" / "h200-xeon16-design-facts.json"  # bf16 ratio below threshold
SMALL = 0.5  # GiB: less than the tiny model + the 1 GiB margin, so resident does not fit


def start(model_dir, **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=1,
                          cpu_moe_threads=1, **kw)  # fmt: skip
    engine = LLMEngine(config)
    engine.close()  # the resolution is made at startup; nothing needs to run
    return engine


def lines(ft_log, start: str) -> list[str]:
    return [r.getMessage() for r in ft_log.records if r.getMessage().startswith(start)]


def bf16_fetch_fraction(path) -> float:
    """docs/profile.md, from the file's own numbers: pcie_ov / (pcie_ov + cpu_ov)."""
    k = json.loads(path.read_text())["dtype_kernels"]["bf16"]
    return k["pcie_gather_overlap_gbs"] / (k["pcie_gather_overlap_gbs"] + k["cpu_moe_overlap_gbs"])


def test_auto_is_resident_when_everything_fits(synth_tiny, ft_log):
    engine = start(synth_tiny[0], moe_strategy="auto", moe_cache_rate=0.25, bw_profile=str(SEED))
    assert engine.config.moe_strategy == "resident" and engine.moe_cache_size is None
    (line,) = lines(ft_log, "--moe-strategy auto resolved resident (all ")
    assert "--moe-cache-* ignored" in line
    assert "Resolved config: moe_strategy='resident'" in ft_log.text


def test_auto_follows_a_profile_that_says_hybrid(synth_tiny, ft_log):
    engine = start(synth_tiny[0], moe_strategy="auto", gpu_memory_limit=SMALL,
                   moe_cache_rate=0.25, bw_profile=str(SEED))  # fmt: skip
    assert engine.config.moe_strategy == "hybrid"
    (line,) = lines(ft_log, "--moe-strategy auto resolved hybrid (bandwidth profile ")
    assert f"{SEED}: bf16 ratio 2.35 >= 2.0; resident needs" in line
    fraction = bf16_fetch_fraction(SEED)
    assert engine.strategy.max_fetch == pytest.approx(fraction)
    assert lines(ft_log, "--moe-hybrid-max-fetch auto: ") == [
        f"--moe-hybrid-max-fetch auto: fetching {fraction:.1%} of each decode step's expert"
        " misses over PCIe (benched PCIe/CPU bandwidth ratio), the rest on the CPU"
    ]
    assert "Resolved config: moe_strategy='hybrid'" in ft_log.text


def test_auto_follows_a_profile_that_says_offload(synth_tiny, ft_log):
    engine = start(synth_tiny[0], moe_strategy="auto", gpu_memory_limit=SMALL,
                   moe_cache_rate=0.25, bw_profile=str(H200))  # fmt: skip
    assert engine.config.moe_strategy == "offload"
    (line,) = lines(ft_log, "--moe-strategy auto resolved offload (bandwidth profile ")
    assert "bf16 ratio 0.83 < 2.0" in line
    assert not lines(ft_log, "CPU MoE executor ready")


@pytest.mark.parametrize("problem", ["missing", "malformed"])
def test_auto_without_a_usable_profile_is_offload(synth_tiny, ft_log, tmp_path, problem):
    path = tmp_path / "benchbw.json"
    if problem == "malformed":
        path.write_text('{"version": 4')
    engine = start(synth_tiny[0], moe_strategy="auto", gpu_memory_limit=SMALL,
                   moe_cache_rate=0.25, bw_profile=str(path))  # fmt: skip
    assert engine.config.moe_strategy == "offload"
    (line,) = lines(ft_log, "--moe-strategy auto resolved offload (no usable bandwidth profile: ")
    assert str(path) in line


def test_auto_profile_defaults_to_the_cache_dir(synth_tiny, ft_log, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    (tmp_path / "benchbw.json").write_text(SEED.read_text())
    engine = start(synth_tiny[0], moe_strategy="auto", gpu_memory_limit=SMALL, moe_cache_rate=0.25)
    assert engine.config.moe_strategy == "hybrid"
    assert lines(ft_log, f"--moe-strategy auto resolved hybrid (bandwidth profile {tmp_path}")


def test_hybrid_fetch_auto_without_a_profile_falls_back(synth_tiny, ft_log, tmp_path):
    engine = start(synth_tiny[0], moe_strategy="hybrid", moe_cache_rate=0.25,
                   bw_profile=str(tmp_path / "none.json"))  # fmt: skip
    assert engine.strategy.max_fetch == 0.5
    (record,) = [r for r in ft_log.records if "no usable bandwidth profile" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "fetching 50.0% of each decode step's expert misses over PCIe (fallback)" in (
        record.getMessage()
    )


def test_hybrid_fetch_given_by_flag(synth_tiny, ft_log):
    engine = start(synth_tiny[0], moe_strategy="hybrid", moe_cache_rate=0.25,
                   moe_hybrid_max_fetch="0.25", bw_profile=str(SEED))  # fmt: skip
    assert engine.strategy.max_fetch == 0.25
    assert lines(ft_log, "--moe-hybrid-max-fetch 0.25: fetching 25.0% of each decode step's")


def test_hybrid_fetch_auto_with_a_gpu_less_profile_falls_back(synth_tiny, ft_log, tmp_path):
    data = json.loads(SEED.read_text())
    for key in ("pcie_gather_gbs", "pcie_gather_overlap_gbs", "cpu_moe_overlap_gbs"):
        data["dtype_kernels"]["bf16"][key] = None  # what `ft bench bw` writes without a GPU
    path = tmp_path / "cpu-only.json"
    path.write_text(json.dumps(data))
    engine = start(synth_tiny[0], moe_strategy="hybrid", moe_cache_rate=0.25, bw_profile=str(path))
    assert engine.strategy.max_fetch == 0.5
    (line,) = lines(ft_log, "--moe-hybrid-max-fetch auto: no usable bandwidth profile (")
    assert f"{path} has no overlapped numbers for bf16" in line
