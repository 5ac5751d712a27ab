"""Tiny checkpoints for engine tests: written by transformers itself or by `ft model synth`."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

QWEN3 = {
    "qwen3-gqa-norm": dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen3-mha-nonorm-dense0": dict(
        num_attention_heads=4, num_key_value_heads=4, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True,
    ),
    "qwen3-wide-heads-step2": dict(  # H*d = 64 != hidden 32; layer 0 dense by sparse step
        num_attention_heads=8, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=2,
    ),
}  # fmt: skip
MIXTRAL = {
    "mixtral-gqa": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2),
    "mixtral-mqa-k3": dict(num_attention_heads=4, num_key_value_heads=1, num_local_experts=8,
                           num_experts_per_tok=3),
}  # fmt: skip


def hf_model(name: str):
    """A randomly initialised tiny transformers model (float32, eval mode)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(zlib.crc32(name.encode()))  # stable across runs, unlike hash()
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, initializer_range=0.15)
    if name in QWEN3:
        cfg = Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                             **QWEN3[name])  # fmt: skip
        return Qwen3MoeForCausalLM(cfg).eval()
    cfg = MixtralConfig(**common, intermediate_size=16, **MIXTRAL[name])
    return MixtralForCausalLM(cfg).eval()


def save_hf(name: str, out: Path) -> Path:
    hf_model(name).save_pretrained(out)
    return out


def fuse_experts(src: Path, dst: Path) -> Path:
    """Rewrite a per-expert checkpoint with transformers 5's fused 3-D expert tensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}.mlp.experts"
        if f"{base}.0.gate_proj.weight" not in tensors:
            continue

        def pop(part: str, e: int, base: str = base) -> torch.Tensor:
            return tensors.pop(f"{base}.{e}.{part}.weight")

        gate_up = [torch.cat([pop("gate_proj", e), pop("up_proj", e)]) for e in range(experts)]
        tensors[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{base}.down_proj"] = torch.stack([pop("down_proj", e) for e in range(experts)])
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def make_synth_tiny(tmp_path_factory):
    """A `tiny` checkpoint from `ft model synth` (float32, 2 layers) and its routing stats."""
    from ft.engine.synth.checkpoint import synth_checkpoint

    out = tmp_path_factory.mktemp("synth") / "tiny"
    stats = synth_checkpoint("tiny", out, layers=2, dtype="float32", seed=1)
    return out, stats


def hf_greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()
