"""hybrid: the split rule, greedy parity with resident, the CPU's share really in the pool."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from ft.engine.config import EngineConfig
from ft.engine.cpu.pool import THREAD_PREFIX
from ft.engine.runner import LLMEngine, SamplingParams
from ft.engine.strategies.hybrid import ROUND_TRIP, RoundTrip, split_misses
from tests.engine.test_runner import PROMPTS, run_all

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def engine_for(model_dir, **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, **kw)
    return LLMEngine(config)


def hybrid(model_dir, max_fetch, slots=4, **kw) -> LLMEngine:
    return engine_for(model_dir, moe_strategy="hybrid", moe_cache_size=slots,
                      moe_hybrid_max_fetch=max_fetch, cpu_moe_threads=2, **kw)  # fmt: skip


# -- split_misses -------------------------------------------------------------------------------


def test_split_fetches_experts_with_more_tokens_first():
    fetch, cpu = split_misses([10, 11, 12, 13], [1, 3, 2, 1], max_fetch=0.5, prefill_threshold=4)
    assert fetch == [11, 12] and cpu == [10, 13]  # the given order is kept in both


def test_split_ties_keep_the_given_order():
    fetch, cpu = split_misses([7, 3, 9, 5], [1, 1, 1, 1], max_fetch=0.5, prefill_threshold=4)
    assert fetch == [7, 3] and cpu == [9, 5]


def test_split_always_fetches_experts_past_the_prefill_threshold():
    fetch, cpu = split_misses([1, 2, 3], [12, 1, 5], max_fetch=0.0, prefill_threshold=4)
    assert fetch == [1, 3] and cpu == [2]
    fetch, cpu = split_misses([1, 2, 3, 4], [12, 1, 2, 1], max_fetch=0.5, prefill_threshold=4)
    assert fetch == [1, 3] and cpu == [2, 4]  # the forced one counts toward the fraction


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.278, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 10])
def test_split_rounds_the_fraction_half_up(fraction, n):
    fetch, cpu = split_misses(list(range(n)), [1] * n, fraction, prefill_threshold=4)
    assert len(fetch) == math.floor(fraction * n + 0.5)
    assert sorted(fetch + cpu) == list(range(n))


def test_split_zero_and_one():
    assert split_misses([4, 5], [2, 3], 0.0, 4) == ([], [4, 5])
    assert split_misses([4, 5], [2, 3], 1.0, 4) == ([4, 5], [])
    assert split_misses([], [], 0.5, 4) == ([], [])
    with pytest.raises(ValueError):
        split_misses([1, 2], [1], 0.5, 4)


def test_a_round_trip_sums_each_part_over_the_layers():
    trip = RoundTrip()
    trip.add([0.0, 1e-6, 3e-6, 6e-6, 10e-6, 15e-6])  # parts of 1, 2, 3, 4, 5 us
    trip.add([1.0, 1.0, 1.0 + 2e-6, 1.0 + 2e-6, 1.0 + 2e-6, 1.0 + 3e-6])
    assert trip.counters() == {"cpu_layers": 2, "cpu_inputs_us": 1, "cpu_submit_us": 4,
                               "cpu_cache_us": 3, "cpu_wait_us": 4, "cpu_share_us": 6}  # fmt: skip
    with pytest.raises(ValueError, match="6 stamps, got 5"):
        trip.add([0.0] * 5)


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resident_ids(synth_tiny):
    engine = engine_for(synth_tiny[0])
    try:
        return run_all(engine, PROMPTS, GREEDY), engine.stats.expert_uses
    finally:
        engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "max_fetch,slots", [(0.0, 4), (0.3, 4), (1.0, 4), (0.0, 12), (0.3, 12)]
)  # 4 slots: batches of 2-3 (8-12 pairs) group on the host; 12: every decode step takes the
# stop-and-compute path that graphed decode replays
def test_hybrid_equals_resident_and_counters_add_up(synth_tiny, resident_ids, max_fetch, slots):
    want, uses = resident_ids
    threads_before = torch.get_num_threads()
    engine = hybrid(synth_tiny[0], max_fetch, slots, moe_gates=False)  # its host stops
    try:
        assert run_all(engine, PROMPTS, GREEDY) == want
        stats, strategy = engine.stats, engine.strategy
    finally:
        engine.close()
    assert torch.get_num_threads() == threads_before  # close() gave torch its threads back
    assert stats.expert_uses == uses  # same routing as resident
    assert stats.cache_hits + stats.cache_misses == stats.expert_uses
    cpu = stats.experts_cpu + stats.experts_cpu_inline
    assert stats.cache_misses == stats.experts_fetched + cpu
    assert stats.experts_cpu == strategy.experts_cpu_total and stats.experts_cpu_inline == 0
    assert stats.bytes_fetched == stats.experts_fetched * strategy.store.expert_bytes
    if max_fetch == 1.0:
        assert stats.experts_cpu == 0 and not strategy.cpu_threads
    else:
        assert stats.experts_cpu > 0 and stats.experts_fetched > 0
        assert strategy.cpu_threads and all(
            name.startswith(THREAD_PREFIX) for name in strategy.cpu_threads
        )  # the expert FFNs ran on the pool's threads, none on the engine's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_fetch,slots", [(0.0, 4), (0.3, 12), (1.0, 12)])
def test_hybrid_on_gates_equals_resident(synth_tiny, resident_ids, max_fetch, slots):
    """Eager decode on gates (hybrid's default on CUDA): the host follows each layer first, the
    CPU's misses marked in the table and summed into the layer's share row, the gate opened
    with CPU_SHARE."""
    want, uses = resident_ids
    engine = hybrid(synth_tiny[0], max_fetch, slots, moe_gates=True)
    try:
        assert type(engine.strategy).__name__ == "GatedHybridStrategy"
        assert run_all(engine, PROMPTS, GREEDY) == want
        stats, strategy = engine.stats, engine.strategy
    finally:
        engine.close()
    assert stats.expert_uses == uses and stats.cache_hits + stats.cache_misses == uses
    assert stats.experts_cpu == strategy.experts_cpu_total and stats.experts_cpu_inline == 0
    if max_fetch == 1.0:
        assert stats.experts_cpu == 0 and not strategy.cpu_threads
    else:
        assert 0 < stats.experts_cpu <= stats.cache_misses
        assert all(name.startswith(THREAD_PREFIX) for name in strategy.cpu_threads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gates", [False, True])
def test_each_decode_layer_with_cpu_experts_times_its_round_trip(synth_tiny, gates):
    """Host stops and gates alike: a decode step's cpu_layers is at least one and at most its
    CPU experts wherever it had some, zero where it had none, and each part is timed within
    the step."""
    engine = hybrid(synth_tiny[0], 0.3, moe_gates=gates)  # 4 slots: one token's pairs fit
    steps = []
    try:
        for prompt in PROMPTS[:2]:  # one sequence at a time: every decode layer takes the stop
            engine.add_request(prompt, GREEDY)
            while engine.has_unfinished():
                engine.step()
                steps.append(engine.last_step)
    finally:
        engine.close()
    parts = [f"cpu_{part}_us" for part in ROUND_TRIP]
    decode = [s for s in steps if s["phase"] == "decode"]
    assert sum(s["experts_cpu"] > 0 for s in decode) > 0  # the test needs CPU experts
    for s in decode:
        assert (s["cpu_layers"] > 0) == (s["experts_cpu"] > 0)
        assert s["cpu_layers"] <= s["experts_cpu"]
        assert all(s[p] >= 0 for p in parts) and sum(s[p] for p in parts) <= s["seconds"] * 1e6
    timed = [s for s in decode if s["cpu_layers"]]
    assert sum(s["cpu_wait_us"] + s["cpu_submit_us"] for s in timed) > 0


@pytest.mark.timeout(120)
def test_prefill_experts_with_many_tokens_are_fetched(synth_tiny):
    engine = hybrid(synth_tiny[0], 0.0)
    try:
        engine.add_request(list(range(40, 72)), SamplingParams(max_tokens=1))  # 32-token prefill
        engine.step()
        step = engine.last_step
    finally:
        engine.close()
    assert step["phase"] == "prefill" and step["experts_fetched"] > 0  # despite max_fetch 0


@pytest.mark.timeout(120)
def test_inline_fault_runs_on_the_engine_thread_and_warns_once(synth_tiny, resident_ids, ft_log):
    engine = hybrid(synth_tiny[0], 0.0, cpu_moe_inline=True)
    try:
        assert run_all(engine, PROMPTS, GREEDY) == resident_ids[0]
        stats, ran_on = engine.stats, engine.strategy.cpu_threads
    finally:
        engine.close()
    assert ran_on == {threading.current_thread().name}
    assert stats.experts_cpu == 0 and stats.experts_cpu_inline > 0
    # on gates (the default) a miss no slot could be had for is read in place
    assert stats.cache_misses == (
        stats.experts_fetched + stats.experts_in_place + stats.experts_cpu_inline
    )
    warnings = [r for r in ft_log.records if "outside the pool" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_inline_fault_from_the_environment(monkeypatch):
    monkeypatch.setenv("FT_CPU_MOE_INLINE", "1")
    assert EngineConfig(model="m", device="cpu").cpu_moe_inline  # shown in Resolved config


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gates", [False, True])
def test_cuda_hybrid_matches_resident_on_the_first_tokens(synth_tiny, gates):
    """Device kernels vs the CPU pool's: near-ties may differ late, so compare the start. With
    gates, decode is the graphed step the host follows: the CPU's sums reach the device
    through the share rows and the gates opened with CPU_SHARE."""
    cuda = dict(device="cuda", dtype="float32", max_num_seqs=4)
    resident = LLMEngine(EngineConfig(model=str(synth_tiny[0]), **cuda))
    want = run_all(resident, PROMPTS, GREEDY)
    resident.close()
    hybrid = dict(moe_strategy="hybrid", moe_cache_size=4, moe_hybrid_max_fetch=0.3,
                  moe_gates=gates)  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), **hybrid, **cuda))
    try:
        got = run_all(engine, PROMPTS, GREEDY)
        stats, ran_on = engine.stats, engine.strategy.cpu_threads
    finally:
        engine.close()
    assert {i: ids[:4] for i, ids in got.items()} == {i: ids[:4] for i, ids in want.items()}
    assert stats.experts_cpu > 0 and stats.experts_fetched > 0
    assert ran_on and all(name.startswith(THREAD_PREFIX) for name in ran_on)
