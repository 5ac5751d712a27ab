"""The strategies' batched paths: resident decode never groups on the host, offload's
compute_slots (hybrid's seam) computes any subset of groups, and the log names the kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from ft.engine.experts.dispatch import add_expert, group_by_expert
from ft.engine.strategies import base
from ft.engine.strategies.offload import OffloadStrategy
from ft.engine.strategies.resident import ResidentStrategy
from tests.engine.test_expert_cache import make_store


def routed(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(tokens)])  # [T, K]
    return torch.randn(tokens, 8, generator=gen), ids, torch.rand(tokens, 3, generator=gen)


def test_resident_decode_groups_nothing_on_the_host(monkeypatch):
    calls = []
    monkeypatch.setattr(base, "group_by_expert", lambda *a: calls.append(1) or group_by_expert(*a))
    store = make_store()
    resident, offload = ResidentStrategy(store, "cpu"), OffloadStrategy(store, "cpu", num_slots=4)
    x, ids, weights = routed(tokens=4)
    got = resident.forward(1, x, ids, weights)
    assert calls == []  # decode: the work list is built on the device (offload groups: 1 sync)
    torch.testing.assert_close(got, offload.forward(1, x, ids, weights))
    assert resident.counters()["expert_uses"] == offload.counters()["expert_uses"]
    x, ids, weights = routed(tokens=60)  # prefill-sized: grouped on the host, once
    torch.testing.assert_close(
        resident.forward(0, x, ids, weights), offload.forward(0, x, ids, weights)
    )
    assert len(calls) == 3  # offload's decode, then each strategy's prefill


def test_compute_slots_on_a_subset_adds_up_to_the_whole():
    store = make_store()
    offload = OffloadStrategy(store, "cpu", num_slots=6)
    x, ids, weights = routed(tokens=5, seed=1)
    groups = group_by_expert(ids, weights, 6)
    device_part, cpu_part = groups[::2], groups[1::2]  # as hybrid splits a layer's misses
    out = torch.zeros_like(x)
    offload.compute_slots(
        x, device_part, offload.cache.ensure(0, [g.expert for g in device_part]), out
    )
    for g in cpu_part:
        add_expert(out, x, g, store.banks[0]["w13"][g.expert], store.banks[0]["w2"][g.expert])
    torch.testing.assert_close(out, ResidentStrategy(store, "cpu").forward(0, x, ids, weights))


@pytest.mark.parametrize("strategy", ["resident", "offload"])
def test_startup_log_names_the_expert_kernel(synth_tiny, caplog, strategy):
    from ft.engine.config import EngineConfig
    from ft.engine.runner import LLMEngine

    kw = {"moe_cache_size": 4} if strategy == "offload" else {}
    with caplog.at_level(logging.INFO, logger="ft.engine"):
        engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), device="cpu",
                                        moe_strategy=strategy, **kw))  # fmt: skip
    assert engine.strategy.kernel == "torch"  # the CPU device has no Triton path
    assert "MoE experts: bf16 via torch" in caplog.text
