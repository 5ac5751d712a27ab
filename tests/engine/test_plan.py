"""decode_plan: the one place that decides what the engine does for a configuration."""

from __future__ import annotations

import pytest

import ft.engine.config as config_module
from ft.engine.config import EngineConfig
from ft.engine.strategies import GRAPH_MODES, decode_plan
from ft.errors import FtError


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(config_module, "_resolve_device", lambda device: device)  # no GPU needed


@pytest.mark.parametrize(
    "settings, kind, graphs, depths, window",
    [
        (dict(moe_strategy="resident"), "ResidentStrategy", "step", None, None),  # no cache
        (dict(moe_strategy="offload"), "GatedOffloadStrategy", "follow", (3, 2), 2),
        (dict(moe_strategy="offload", moe_gates=False), "OffloadStrategy", "stretch", (2, 2), 2),
        (dict(moe_strategy="hybrid"), "GatedHybridStrategy", "follow", (3, 2), 2),
        (dict(moe_strategy="hybrid", moe_gates=False), "HybridStrategy", "stretch", (2, 2), 0),
        (dict(moe_strategy="offload", moe_prefetch=False), "GatedOffloadStrategy", "follow",
         (0, 0), 2),
    ],
)  # fmt: skip
def test_the_plan_on_cuda_names_the_class_its_graphs_and_its_prefetch(
    on_cuda, settings, kind, graphs, depths, window
):
    plan = decode_plan(EngineConfig(model="m", device="cuda", **settings))
    assert (plan.strategy.__name__, plan.graphs) == (kind, graphs)
    assert plan.graphs in GRAPH_MODES
    if depths is not None:
        assert (plan.prefetch_depths, plan.prefetch_window) == (depths, window)


@pytest.mark.parametrize(
    "settings, kind",
    [
        (dict(moe_strategy="resident"), "ResidentStrategy"),
        (dict(moe_strategy="offload"), "GatedOffloadStrategy"),
        (dict(moe_strategy="hybrid"), "HybridStrategy"),  # host stops on the CPU by default
        (dict(moe_strategy="hybrid", moe_gates=True), "GatedHybridStrategy"),
    ],
)
def test_on_the_cpu_every_plan_runs_eagerly(settings, kind):
    plan = decode_plan(EngineConfig(model="m", device="cpu", **settings))
    assert (plan.strategy.__name__, plan.graphs) == (kind, "eager")


def test_cuda_graphs_off_makes_every_plan_eager(on_cuda, monkeypatch):
    monkeypatch.setenv("FT_CUDA_GRAPHS", "0")
    for strategy in ("resident", "offload", "hybrid"):
        config = EngineConfig(model="m", device="cuda", moe_strategy=strategy)
        assert decode_plan(config).graphs == "eager"


def test_auto_is_resolved_before_a_plan_is_made():
    with pytest.raises(FtError, match="auto"):
        decode_plan(EngineConfig(model="m", device="cpu", moe_strategy="auto"))
