"""The Qwen3-MoE / Mixtral decoder, batched over several sequences. Each MoE layer calls the
one strategy object; the model has no strategy branches.

Legend: T = tokens, D = hidden, H = heads, G = kv heads, d = head_dim, E = experts, K = top-k,
V = vocab, B = sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.engine.attention import Batch, Rope, attend
from ft.engine.config import ModelConfig

# short name -> HF name under `model.layers.{i}.`
LAYER_TENSORS = {
    "ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "router": "mlp.gate.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's rounding (normalise in float32, cast, then scale), in 4 launches instead of 8."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * x32.to(x.dtype)


def route(cfg: ModelConfig, router: torch.Tensor, x: torch.Tensor):
    """Softmax top-k router: -> topk_ids [T, K], topk_weights [T, K]."""
    probs = F.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def layer_weights(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    return {
        short: weights[prefix + hf] for short, hf in LAYER_TENSORS.items() if prefix + hf in weights
    }


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, index: int, w: dict, rope: Rope, kv, moe):
        self.cfg, self.index, self.w, self.rope, self.moe = cfg, index, w, rope, moe
        self.k_cache, self.v_cache = kv  # [S, M, G, d] each: this layer's part of the KV cache

    @property
    def is_moe(self) -> bool:
        return "router" in self.w

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, x = self.attend(h, batch)
        return h + (self.sparse_mlp(x) if self.is_moe else self.dense_mlp(x))

    def attend(self, h: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the residual stream after attention, the MLP's normalised input)."""
        h = h + self.attention(rms_norm(h, self.w["ln1"], self.cfg.rms_norm_eps), batch)
        return h, rms_norm(h, self.w["ln2"], self.cfg.rms_norm_eps)

    def attention(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, w, T = self.cfg, self.w, x.shape[0]  # noqa: N806
        q = F.linear(x, w["q"], w.get("q_bias")).view(T, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, w["k"], w.get("k_bias")).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, w["v"], w.get("v_bias")).view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim, before RoPE
            q, k = (
                rms_norm(q, w["q_norm"], cfg.rms_norm_eps),
                rms_norm(k, w["k_norm"], cfg.rms_norm_eps),
            )
        q, k = self.rope.apply(q, batch.positions), self.rope.apply(k, batch.positions)
        o = attend(q, k, v, self.k_cache, self.v_cache, batch)  # [T, H*d]
        return F.linear(o, w["o"], w.get("o_bias"))

    def sparse_mlp(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x)
        return self.moe.forward(self.index, x, topk_ids, topk_weights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.cfg, self.w["router"], x)

    def dense_mlp(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(
            F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"]
        )


class MoeModel:
    """Embedding, decoder layers, final norm, LM head; forward returns each sequence's logits."""

    def __init__(self, cfg: ModelConfig, weights: dict, moe, kv_cache, rope: Rope):
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]  # [V, D]
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.layers = [
            DecoderLayer(
                cfg, i, layer_weights(weights, i), rope, (kv_cache.k[i], kv_cache.v[i]), moe
            )
            for i in range(cfg.num_layers)
        ]

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [B, V] (float32) at the last token of each sequence."""
        h = F.embedding(batch.token_ids, self.embed)  # [T, D]
        for layer in self.layers:
            h = layer.forward(h, batch)
        last = h[batch.last_token_index]  # [B, D]
        return F.linear(rms_norm(last, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
