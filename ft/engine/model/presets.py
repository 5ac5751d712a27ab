"""Named synthetic checkpoint shapes (`ft model synth --preset NAME`), beside the config."""

from __future__ import annotations

from ft.engine.config import DTYPES, check_choice
from ft.errors import FtError

# Synthetic checkpoint shapes (`ft model synth --preset NAME`), as Hugging Face config.json fields.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
    ),
    "demo": dict(  # `ft demo`: big enough experts that hybrid's CPU share shows, seconds to make
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
        intermediate_size=512, vocab_size=512, max_position_embeddings=2048,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
    ),
    "seed-next": dict(
        hidden_size=2560, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640,
        intermediate_size=5120, vocab_size=151936, max_position_embeddings=65536,
    ),
}  # fmt: skip


def preset_hf_config(name: str, layers: int | None, experts: int | None, dtype: str) -> dict:
    """config.json for a named preset (Qwen3-MoE), with optional overrides."""
    if name not in PRESETS:
        raise FtError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    check_choice("dtype", dtype, DTYPES)
    shape = dict(PRESETS[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if experts is not None:
        shape["num_experts"] = experts
    if shape["num_hidden_layers"] < 1 or shape["num_experts"] < shape["num_experts_per_tok"]:
        raise FtError("need at least 1 layer and at least top_k experts")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **shape,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "attention_bias": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False, "dtype": dtype,
        "use_sliding_window": False, "sliding_window": None,
    }  # fmt: skip
