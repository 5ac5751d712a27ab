"""The decode step CUDA graphs replay: padded-KV decode, and decode cut into stretches at the
offload strategy's host stops, equal the engine's decode on the CPU; on CUDA, FT_CUDA_GRAPHS=1
gives the same tokens and counters as eager decode, for resident and for offload."""

from __future__ import annotations

import pytest
import torch

from ft.engine.config import EngineConfig
from ft.engine.graphs import Handoff, cut_layers, decode_logits, kv_bucket, run_step, run_stretch
from ft.engine.runner import LLMEngine, SamplingParams

PROMPTS = [[5, 9, 13], [40, 2, 77, 31, 8, 1, 6], [88]]


def test_kv_bucket_rounds_up_and_caps():
    assert (kv_bucket(1, 4096), kv_bucket(256, 4096), kv_bucket(257, 4096)) == (256, 256, 512)
    assert kv_bucket(300, 320) == 320
    assert kv_bucket(1, 4096, bucket=4096) == kv_bucket(4000, 4096, bucket=4096) == 4096


def test_padded_decode_equals_the_model_forward(synth_tiny):
    engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), device="cpu", max_model_len=64))
    batch = decode_batch(engine)
    expected = engine.model.forward(batch)  # also writes this step's K/V
    got = decode_logits(engine.model, batch.token_ids, batch.positions, batch.slots, kv_len=64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def decode_batch(engine):
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # prefill all three
    seqs, _ = engine.scheduler.schedule()
    return engine._batch(seqs, is_prefill=False)


@pytest.mark.parametrize(
    "strategy_name,depth",
    [("offload", 0), ("offload", 1), ("offload", 2), ("hybrid", 0), ("hybrid", 2)],
)
def test_stretches_between_host_stops_equal_the_model_forward(synth_tiny, strategy_name, depth):
    config = EngineConfig(
        model=str(synth_tiny[0]), device="cpu", max_model_len=64, moe_strategy=strategy_name,
        moe_cache_size=14, moe_prefetch=depth > 0, moe_prefetch_depth=max(depth, 1),
        moe_hybrid_max_fetch=0.3, cpu_moe_threads=1,
        moe_gates=False,  # the host stops of offload and hybrid (gates: test_gates.py)
    )  # fmt: skip
    engine = LLMEngine(config)
    model, strategy = engine.model, engine.strategy
    assert strategy.prefetch_depth == depth
    batch = decode_batch(engine)
    cuts = cut_layers(model, strategy)
    assert cuts == engine.model_config.moe_layers  # a stop at every MoE layer
    dtype, top_k = model.embed.dtype, model.cfg.top_k
    buffers = [Handoff.allocate(4, model.cfg, dtype, "cpu", depth) for _ in range(2)]
    inputs = (batch.token_ids, batch.positions, batch.slots, 64)
    uses = strategy.counters()["expert_uses"]
    launched = []

    def launch(k):
        launched.append(k)
        out = run_stretch(model, cuts, k, buffers[k % 2], buffers[(k + 1) % 2], inputs)
        if k < len(cuts):  # the cut's routed ids, then the next `depth` cuts' guesses
            assert out.stop.shape == (3, (1 + depth) * top_k)
            ahead = cuts[k + 1 : k + 1 + depth]
            for j, cut in enumerate(ahead):  # each guess is that cut's router on this input
                guess = model.layers[cut].route(out.x)[0]
                torch.testing.assert_close(out.stop[:, (j + 1) * top_k : (j + 2) * top_k], guess)
        return out

    out = run_step(strategy, cuts, launch)
    assert launched == list(range(len(cuts) + 1))
    counters = strategy.counters()
    stretched_uses = counters["expert_uses"] - uses
    assert (counters["experts_prefetched"] > 0) == (depth > 0)
    assert counters["cache_hits"] + counters["cache_misses"] == counters["expert_uses"]
    assert (counters["experts_cpu"] > 0) == (strategy_name == "hybrid")  # the CPU's share ran
    expected = model.forward(batch)  # eager: the strategy's own per-layer sync path
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # keys padded to 64 here
    assert strategy.counters()["expert_uses"] - uses == 2 * stretched_uses
    engine.close()


class RecordingStrategy:
    """Stands in for offload at the stops: records what the host does, in order."""

    prefetch_depth = 1

    def __init__(self):
        self.calls = []

    def depth_at(self, batch):
        return self.prefetch_depth

    def prepare(self, layer, topk_ids, x, topk_weights):
        self.calls.append(("prepare", layer, topk_ids))

    def prefetch(self, layer, topk_ids, keep_layer):
        self.calls.append(("prefetch", layer, topk_ids, keep_layer))


def test_a_stop_prefetches_only_after_the_next_stretch_is_launched():
    strategy, cuts = RecordingStrategy(), [1, 3]
    rows = {0: [[4, 5, 6, 7]], 1: [[6, 7, 0, 1]]}  # K=2: routed ids, then the next cut's guess

    def launch(k):
        strategy.calls.append(("launch", k))
        if k == len(cuts):
            return torch.zeros(1, 8)  # the logits
        return Handoff(*(torch.zeros(1, 4),) * 2, weights=None, stop=torch.tensor(rows[k]))

    out = run_step(strategy, cuts, launch)
    assert out.shape == (1, 8)  # the last stretch's logits
    assert strategy.calls == [
        ("launch", 0), ("prepare", 1, [[4, 5]]),
        ("launch", 1), ("prefetch", 3, [[6, 7]], 1), ("prepare", 3, [[6, 7]]),
        ("launch", 2),
    ]  # fmt: skip


def test_a_stop_prefetches_two_cuts_ahead_nearest_first():
    strategy, cuts = RecordingStrategy(), [1, 3, 5]
    strategy.prefetch_depth = 2
    # K=1: the cut's routed id, then the guesses of the next two cuts (padding past the last)
    rows = {0: [[4, 6, 8]], 1: [[6, 9, 6]], 2: [[9, 9, 9]]}

    def launch(k):
        strategy.calls.append(("launch", k))
        if k == len(cuts):
            return torch.zeros(1, 8)
        stop = torch.tensor(rows[k])
        return Handoff(*(torch.zeros(1, 4),) * 2, weights=None, stop=stop)

    run_step(strategy, cuts, launch)
    assert strategy.calls == [
        ("launch", 0), ("prepare", 1, [[4]]),
        ("launch", 1), ("prefetch", 3, [[6]], 1), ("prefetch", 5, [[8]], 1),
        ("prepare", 3, [[6]]),
        ("launch", 2), ("prefetch", 5, [[9]], 3), ("prepare", 5, [[9]]),
        ("launch", 3),
    ]  # fmt: skip


def test_resident_decode_is_one_stretch(synth_tiny):
    engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), device="cpu", max_model_len=64))
    assert cut_layers(engine.model, engine.strategy) == []


def generate(model_dir, monkeypatch, graphs: bool, **config):
    monkeypatch.setenv("FT_CUDA_GRAPHS", "1" if graphs else "0")
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", **config))
    assert (engine.graphs is not None) == graphs
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.seq_id].append(out.token_id)
    engine.close()  # hybrid's pool threads
    return [outs[i] for i in ids], engine.stats


@pytest.mark.gpu
def test_cuda_graphs_decode_like_eager(synth_tiny, monkeypatch):
    eager, eager_stats = generate(synth_tiny[0], monkeypatch, graphs=False)
    graphed, graphed_stats = generate(synth_tiny[0], monkeypatch, graphs=True)
    assert graphed == eager
    assert graphed_stats.expert_uses == eager_stats.expert_uses  # warm-ups are not counted


@pytest.mark.gpu
@pytest.mark.parametrize(
    "strategy_name,prefetch",
    [("offload", False), ("offload", True), ("hybrid", False), ("hybrid", True)],
)
def test_host_stop_graphs_decode_like_eager(synth_tiny, monkeypatch, strategy_name, prefetch):
    config = dict(moe_strategy=strategy_name, moe_cache_size=14, moe_prefetch=prefetch)  # evicts
    config.update(moe_gates=False)  # host stops (gates: test_gates.py, test_hybrid.py)
    if strategy_name == "hybrid":
        config.update(moe_hybrid_max_fetch=0.3, cpu_moe_threads=2)
    eager, eager_stats = generate(synth_tiny[0], monkeypatch, graphs=False, **config)
    graphed, graphed_stats = generate(synth_tiny[0], monkeypatch, graphs=True, **config)
    assert graphed == eager
    assert graphed_stats.expert_uses == eager_stats.expert_uses
    assert graphed_stats.cache_hits + graphed_stats.cache_misses == graphed_stats.expert_uses
    if not prefetch:  # prefetching changes what is cached, so hits and bytes may differ
        for field in ("cache_hits", "cache_misses", "bytes_fetched"):
            assert getattr(graphed_stats, field) == getattr(eager_stats, field), field
