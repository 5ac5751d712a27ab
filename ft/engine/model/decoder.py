"""The Qwen3-MoE / Mixtral decoder, batched over several sequences. Each MoE layer calls the
one strategy object; the model has no strategy branches.

Legend: T = tokens, D = hidden, H = heads, G = kv heads, d = head_dim, E = experts, K = top-k,
V = vocab, B = sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.engine.config import ModelConfig
from ft.engine.experts.grouped import pick_backend
from ft.engine.model.attention import Batch, Rope, attend, decode_backend
from ft.engine.model.fused import add_rms_norm, qk_norm_rope, route_topk

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


def route(cfg: ModelConfig, router, x, backend: str = "torch", out=None, mirror=None):
    """Softmax top-k router: -> topk_ids [T, K], topk_weights [T, K]. `router` may be several
    routers' [E, D] stacked ([R E, D]): then ids [T, R K], each router's top-k in turn, and the
    first router's weights (ft.engine.model.fused.route_topk; out: the buffers to write; mirror:
    where the ids are also written)."""
    routers = router.shape[0] // cfg.num_experts
    logits = F.linear(x, router)
    return route_topk(logits, cfg.top_k, cfg.norm_topk_prob, x.dtype, backend, routers, out, mirror)


def take_layer_weights(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The layer's tensors by short name, removed from `weights` (the layer then owns them, so
    fusing them below frees the originals one layer at a time)."""
    prefix = f"model.layers.{layer}."
    return {
        short: weights.pop(prefix + hf)
        for short, hf in LAYER_TENSORS.items()
        if prefix + hf in weights
    }


def fuse_attention_inputs(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
    """q, k, v projections as one matmul (w["qkv"]; q/k/v stay as views of it), and q's and k's
    RMSNorm weights as one [H + G, d] table, so decode launches 1 GEMM and 1 norm, not 3 and 2."""
    qkv = torch.cat((w["q"], w["k"], w["v"]))  # [(H + 2G) d, D]
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    w["qkv"], w["q"], w["k"], w["v"] = qkv, qkv[:qd], qkv[qd : qd + kvd], qkv[qd + kvd :]
    if "q_bias" in w:
        w["qkv_bias"] = torch.cat((w["q_bias"], w["k_bias"], w["v_bias"]))
    if cfg.qk_norm:
        H, G, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim  # noqa: N806
        w["qk_norm"] = torch.cat((w["q_norm"].expand(H, d), w["k_norm"].expand(G, d)))


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, index: int, w: dict, rope: Rope, kv, moe):
        fuse_attention_inputs(cfg, w)
        self.cfg, self.index, self.w, self.rope, self.moe = cfg, index, w, rope, moe
        self.k_cache, self.v_cache = kv  # [S, M, G, d] each: this layer's part of the KV cache
        self.kernel = fused_kernel(w["ln1"].device, cfg.head_dim)  # "triton" | "torch"
        self.decode = decode_backend(self.kernel, cfg.head_dim)  # "triton" | "sdpa"

    @property
    def is_moe(self) -> bool:
        return "router" in self.w

    def forward(self, h, delta, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives and leaves as h + delta, so that each add is fused with
        the RMSNorm after it: -> (h, the MLP's output)."""
        h, x = self.attend(h, delta, batch)
        return h, (self.sparse_mlp(x) if self.is_moe else self.dense_mlp(x))

    def attend(self, h, delta, batch: Batch, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the residual stream after attention, the MLP's normalised input), written into
        `out`'s two [T, D] tensors if given."""
        eps, kernel = self.cfg.rms_norm_eps, self.kernel
        h, x = add_rms_norm(h, delta, self.w["ln1"], eps, kernel)
        return add_rms_norm(h, self.attention(x, batch), self.w["ln2"], eps, kernel, out)

    def attention(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, w, T, H, G = self.cfg, self.w, x.shape[0], self.cfg.num_heads, self.cfg.num_kv_heads  # noqa: N806
        qkv = F.linear(x, w["qkv"], w.get("qkv_bias")).view(T, H + 2 * G, cfg.head_dim)
        qk, v = qkv[:, : H + G], qkv[:, H + G :]  # q's and k's heads: norm and RoPE together
        qk_norm = w.get("qk_norm")  # Qwen3: RMSNorm over head_dim, before RoPE
        qk = qk_norm_rope(qk, qk_norm, self.rope, batch.positions, cfg.rms_norm_eps, self.kernel)
        o = attend(qk[:, :H], qk[:, H:], v, self.k_cache, self.v_cache, batch, self.decode)
        return F.linear(o, w["o"], w.get("o_bias"))

    def sparse_mlp(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x)
        return self.moe.forward(self.index, x, topk_ids, topk_weights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.cfg, self.w["router"], x, self.kernel)

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
                cfg, i, take_layer_weights(weights, i), rope, (kv_cache.k[i], kv_cache.v[i]), moe
            )
            for i in range(cfg.num_layers)
        ]
        # every MoE layer's router as rows of one tensor, in layer order: decode's stop at one
        # routes it and guesses the next ones' routing in one GEMM over consecutive rows
        moe_layers = [layer for layer in self.layers if layer.is_moe]
        routers = [layer.w["router"] for layer in moe_layers]
        self.routers = torch.cat(routers) if routers else None
        E = cfg.num_experts  # noqa: N806
        for j, layer in enumerate(moe_layers):
            layer.w["router"] = self.routers[j * E : (j + 1) * E]

    def routers_of(self, first: int, count: int) -> torch.Tensor:
        """The routers of MoE layers first, first + 1, ... (`count`, counted among MoE layers
        only) stacked [count E, D], a view: model.route over it routes them all at once."""
        E = self.cfg.num_experts  # noqa: N806
        return self.routers[first * E : (first + count) * E]

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [B, V] (float32) at the last token of each sequence."""
        h, delta = F.embedding(batch.token_ids, self.embed), None  # [T, D]
        for layer in self.layers:
            h, delta = layer.forward(h, delta, batch)
        last = batch.last_token_index
        return self.logits(h[last], delta[last])  # [B, V]

    def logits(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the stream h + delta [B, D], and the LM head -> [B, V] float32."""
        kernel = self.layers[0].kernel
        _, x = add_rms_norm(h, delta, self.norm, self.cfg.rms_norm_eps, kernel)
        return F.linear(x, self.lm_head).float()


def fused_kernel(device: torch.device, head_dim: int) -> str:
    """Triton for the fused norm kernels where the MoE kernels are Triton and d is a power of 2."""
    power_of_two = head_dim & (head_dim - 1) == 0
    return "triton" if pick_backend(device) == "triton" and power_of_two else "torch"
