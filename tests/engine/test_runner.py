"""LLMEngine: concurrent sequences, seeded sampling, stop conditions, abort, stats."""

from __future__ import annotations

import pytest

from ft.engine.config import EngineConfig
from ft.engine.runner import LLMEngine, SamplingParams
from ft.errors import FtError

PROMPTS = [[5, 9, 13], [40, 2, 77, 31, 8, 1, 6], [88], [12, 12, 12, 12]]


def engine_for(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def run_all(engine, prompts, params) -> dict[int, list[int]]:
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    outs: dict[int, list[int]] = {i: [] for i in ids.values()}
    while engine.has_unfinished():
        for out in engine.step():
            outs[ids[out.seq_id]].append(out.token_id)
    return outs


def test_concurrent_sequences_equal_one_at_a_time(qwen3_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    together = run_all(engine_for(qwen3_dir, max_num_seqs=4), PROMPTS, params)
    single = engine_for(qwen3_dir, max_num_seqs=1)
    alone = {i: run_all(single, [p], params)[0] for i, p in enumerate(PROMPTS)}
    assert together == alone
    queued = run_all(engine_for(qwen3_dir, max_num_seqs=2), PROMPTS, params)  # waits for slots
    assert queued == alone


def test_offload_concurrent_equals_resident(qwen3_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    resident = run_all(engine_for(qwen3_dir), PROMPTS, params)
    offload = engine_for(qwen3_dir, moe_strategy="offload", moe_cache_size=2)
    assert run_all(offload, PROMPTS, params) == resident
    stats = offload.stats
    assert stats.cache_hits + stats.cache_misses == stats.expert_uses
    step = offload.last_step  # the final decode step alone
    assert step["phase"] == "decode" and step["tokens"] == len(PROMPTS)  # decoded together
    assert step["cache_hits"] + step["cache_misses"] == step["expert_uses"] > 0
    assert stats.prefill_tokens == sum(map(len, PROMPTS))
    assert stats.decode_tokens == 4 * 5  # every token after the first comes from a decode step


def test_seeded_sampling_is_reproducible(synth_tiny):
    model_dir, _ = synth_tiny
    engine = engine_for(model_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = run_all(engine, [PROMPTS[0]], params)[0]
    with_neighbour = run_all(engine, [PROMPTS[0], PROMPTS[1]], params)[0]
    assert first == with_neighbour  # a request's samples do not depend on its batch
    other = run_all(engine, [PROMPTS[0]], SamplingParams(12, 1.0, 1.0, seed=8, ignore_eos=True))[0]
    assert other != first


def test_tiny_top_p_is_greedy(synth_tiny):
    model_dir, _ = synth_tiny
    engine = engine_for(model_dir)
    greedy = run_all(engine, [PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    nucleus = SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True)
    assert run_all(engine, [PROMPTS[1]], nucleus)[0] == greedy


def test_stops_at_eos_and_at_max_tokens(synth_tiny):
    model_dir, _ = synth_tiny
    engine = engine_for(model_dir)
    free = run_all(engine, [PROMPTS[1]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(free) == 6
    eos = free[2]  # pretend the third token is EOS: generation must stop right there
    engine.scheduler.stop_token_ids = {eos}
    seq = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6))
    outs = [o for _ in range(10) for o in engine.step()]
    assert [o.token_id for o in outs] == free[: free.index(eos) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].seq_id == seq


def test_abort_frees_the_slot_and_reports_once(qwen3_dir):
    engine = engine_for(qwen3_dir, max_num_seqs=1)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50))
    second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2))
    engine.step()
    engine.abort(first)
    outs = [o for _ in range(5) for o in engine.step()]
    assert outs[0].seq_id == first and outs[0].finish_reason == "abort"
    assert [o.seq_id for o in outs[1:]] == [second, second] and not engine.has_unfinished()


def test_bad_prompts_are_user_errors(qwen3_dir):
    engine = engine_for(qwen3_dir, max_model_len=16)
    for prompt in ([], [1] * 16, [10_000]):
        with pytest.raises(FtError):
            engine.add_request(prompt)


def test_generation_config_eos_list_stops_too(synth_tiny, tmp_path):
    import json
    import shutil

    model_dir = shutil.copytree(synth_tiny[0], tmp_path / "m")
    free = run_all(engine_for(model_dir), [PROMPTS[2]], SamplingParams(6, ignore_eos=True))[0]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[1], 9999]}))
    stopped = run_all(engine_for(model_dir), [PROMPTS[2]], SamplingParams(max_tokens=6))[0]
    assert stopped == free[: free.index(free[1]) + 1]


def test_kv_reserve_sets_slots_and_caps_max_model_len(qwen3_dir):
    engine = engine_for(qwen3_dir, kv_reserve_tokens=100, max_model_len=32, max_num_seqs=2)
    assert tuple(engine.model.layers[0].k_cache.shape[:2]) == (3, 32)  # 3 slots of 32 tokens
    assert len(engine.scheduler.free_slots) == 2  # but at most max_num_seqs run at once
    short = engine_for(qwen3_dir, kv_reserve_tokens=20, max_model_len=32)
    assert short.max_model_len == 20
    out = run_all(short, [[1, 2, 3]], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out) == 20 - 3  # the sequence ends at max_model_len
