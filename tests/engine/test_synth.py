"""`ft model synth`: HF layout that transformers loads, sharded, skewed and sticky routing."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ft.cli.app import app
from ft.engine.model.shards import ShardWriter
from ft.engine.synth.checkpoint import synth_checkpoint
from ft.errors import FtError


def test_routing_is_skewed_and_reused(synth_tiny):
    _, stats = synth_tiny
    assert stats.top20_share > 0.3  # uniform routing gives 0.2
    assert stats.reuse_rate > 1.3 * stats.uniform_reuse


def test_deep_preset_keeps_routing_skewed(tmp_path):
    """48 layers, as the real presets: the router draw must survive depth."""
    stats = synth_checkpoint("tiny", tmp_path / "deep", layers=48, experts=16, dtype="bfloat16")
    assert stats.layers == 48
    assert stats.top20_share > 0.4 and stats.reuse_rate > 1.5 * stats.uniform_reuse


def test_layout_is_hugging_face(synth_tiny):
    from transformers import AutoConfig, AutoTokenizer

    model_dir, _ = synth_tiny
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((model_dir / s).is_file() for s in shards)
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in index["weight_map"]
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen3_moe" and config.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id == config.eos_token_id
    ids = tok.encode("The expert cache")
    assert tok.decode(ids) == "The expert cache"


@pytest.mark.parametrize("fmt, quant_algo", [("bf16", None), ("nvfp4", "NVFP4")])
def test_cli_prints_measured_stats(tmp_path, fmt, quant_algo):
    out = tmp_path / "ck"
    args = ["model", "synth", "--preset", "tiny", "--out", str(out), "--layers", "2"]
    result = CliRunner().invoke(app, [*args, "--experts", "8", "--expert-format", fmt, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layers"] == 2 and 0.2 < report["top20_share"] <= 1
    assert report["expert_format"] == fmt
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts"] == 8 and config["dtype"] == "bfloat16"  # dense stays float
    assert (config.get("quantization_config") or {}).get("quant_algo") == quant_algo


def test_bad_requests_are_user_errors(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(FtError):
        synth_checkpoint("tiny", tmp_path / "full")  # never overwrites a user's directory
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(FtError):
        synth_checkpoint("nope", tmp_path / "a")
    with pytest.raises(FtError):
        synth_checkpoint("tiny", tmp_path / "b", experts=2)  # fewer experts than top-k


def test_shard_writer_splits_and_indexes(tmp_path):
    import torch
    from safetensors import safe_open

    writer = ShardWriter(tmp_path, limit=100)
    for i in range(5):
        writer.add(f"t{i}", torch.full((10,), float(i)), torch.float32)  # 40 bytes each
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    for name, shard in index.items():
        with safe_open(str(tmp_path / shard), "pt") as f:
            assert f.get_tensor(name)[0].item() == float(name[1:])
