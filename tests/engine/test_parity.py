"""Greedy ids from `ft generate --json` equal transformers' generate(do_sample=False)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ft.cli.app import app
from tests.engine.checkpoints import MIXTRAL, QWEN3, fuse_experts, hf_greedy, save_hf

PROMPT = [3, 17, 42, 8, 61, 5]
MAX_NEW = 10


def ft_generate(model_dir, *extra: str, prompt=PROMPT, max_tokens=MAX_NEW) -> dict:
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-tokens", str(max_tokens), "--device", "cpu", "--dtype", "float32", "--json"]
    result = CliRunner().invoke(app, args + list(extra))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [*QWEN3, *MIXTRAL])
def test_greedy_matches_transformers(name, tmp_path):
    model_dir = save_hf(name, tmp_path / name)
    assert ft_generate(model_dir)["token_ids"] == hf_greedy(model_dir, PROMPT, MAX_NEW)


def test_fused_expert_layout_loads_the_same(qwen3_dir, tmp_path):
    fused = fuse_experts(qwen3_dir, tmp_path / "fused")
    assert ft_generate(fused)["token_ids"] == hf_greedy(qwen3_dir, PROMPT, MAX_NEW)


def test_synth_checkpoint_matches_transformers(synth_tiny):
    model_dir, _ = synth_tiny
    prompt = [300, 12, 7, 451, 88, 19, 2]
    ours = ft_generate(model_dir, prompt=prompt, max_tokens=16)
    assert ours["token_ids"] == hf_greedy(model_dir, prompt, 16)


def test_offload_gives_resident_ids_and_counters_add_up(qwen3_dir):
    resident = ft_generate(qwen3_dir, "--moe-strategy", "resident")
    offload = ft_generate(qwen3_dir, "--moe-strategy", "offload", "--moe-cache-rate", "0.25")
    assert offload["token_ids"] == resident["token_ids"]
    for run in (resident, offload):
        assert run["cache_hits"] + run["cache_misses"] == run["expert_uses"] > 0
    assert offload["expert_uses"] == resident["expert_uses"]
    assert offload["cache_misses"] > 0 and offload["cache_hits"] > 0
    # offload's device gates read in place a miss no slot could be had for (a layer routing
    # more experts than the cache holds), where host stops fetch such a layer in chunks
    assert offload["experts_fetched"] + offload["experts_in_place"] == offload["cache_misses"]
    assert resident["bytes_fetched"] == 0 < offload["bytes_fetched"]


def test_expert_uses_match_transformers_routing(qwen3_dir):
    """Routed (layer, expert) pairs per forward, counted inside transformers, equal ours."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    uses = []
    for block in model.model.layers:
        block.mlp.gate.register_forward_hook(lambda m, i, out: uses.append(out[2].unique().numel()))
    model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False)
    ours = ft_generate(qwen3_dir, "--moe-strategy", "offload", "--moe-cache-size", "3")
    assert ours["expert_uses"] == sum(uses)


def test_text_prompt_without_tokenizer_is_a_user_error(qwen3_dir):
    """transformers' save_pretrained writes no tokenizer: ids work, text says what to do."""
    args = ["generate", "--model", str(qwen3_dir), "--prompt", "hello", "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "pass token ids" in result.output
