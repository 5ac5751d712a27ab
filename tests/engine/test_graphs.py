"""The decode step CUDA graphs replay: padded-KV decode equals the engine's decode on the CPU;
on CUDA, FT_CUDA_GRAPHS=1 gives the same tokens and counters as eager decode."""

from __future__ import annotations

import pytest
import torch

from ft.engine.config import EngineConfig
from ft.engine.graphs import decode_logits, kv_bucket
from ft.engine.runner import LLMEngine, SamplingParams

PROMPTS = [[5, 9, 13], [40, 2, 77, 31, 8, 1, 6], [88]]


def test_kv_bucket_rounds_up_and_caps():
    assert (kv_bucket(1, 4096), kv_bucket(256, 4096), kv_bucket(257, 4096)) == (256, 256, 512)
    assert kv_bucket(300, 320) == 320


def test_padded_decode_equals_the_model_forward(synth_tiny):
    engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), device="cpu", max_model_len=64))
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # prefill all three
    seqs, _ = engine.scheduler.schedule()
    batch = engine._batch(seqs, is_prefill=False)
    expected = engine.model.forward(batch)  # also writes this step's K/V
    got = decode_logits(engine.model, batch.token_ids, batch.positions, batch.slots, kv_len=64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def generate(model_dir, monkeypatch, graphs: bool):
    monkeypatch.setenv("FT_CUDA_GRAPHS", "1" if graphs else "0")
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32"))
    assert (engine.graphs is not None) == graphs
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.seq_id].append(out.token_id)
    return [outs[i] for i in ids], engine.stats


@pytest.mark.gpu
def test_cuda_graphs_decode_like_eager(synth_tiny, monkeypatch):
    eager, eager_stats = generate(synth_tiny[0], monkeypatch, graphs=False)
    graphed, graphed_stats = generate(synth_tiny[0], monkeypatch, graphs=True)
    assert graphed == eager
    assert graphed_stats.expert_uses == eager_stats.expert_uses  # warm-ups are not counted
