"""Fused decoder kernels: residual add + RMSNorm, q/k RMSNorm + RoPE, and the router's softmax
top-k, one launch each on CUDA (Triton) where torch takes 5, 9 and 5; the same arithmetic in
torch elsewhere (and as the reference in tests). The norms round as transformers does:
normalise in float32, cast to the model's dtype, then scale by the weight in that dtype; RoPE's
products and sum each rounded likewise.

Legend: T = tokens, D = hidden, N = heads (q's then k's), d = head_dim, E = experts, K = top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's rounding (normalise in float32, cast, then scale)."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [T, N, d], cos/sin [T, 1, d] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def add_rms_norm(h, delta, weight, eps: float, backend: str = "torch"):
    """-> (h + delta, RMSNorm(h + delta)); delta None: h unchanged. h, delta [T, D]."""
    if backend == "triton" and delta is not None:
        return _triton_add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def qk_norm_rope(qk, weight, cos, sin, eps: float, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over d (weight [N, d], None: no norm) then RoPE, for qk [T, N, d] -> [T, N, d]."""
    if backend == "triton" and weight is not None:
        return _triton_qk_norm_rope(qk, weight, cos, sin, eps)
    if weight is not None:
        qk = rms_norm(qk, weight, eps)
    return rope(qk, cos, sin)


def _triton_add_rms_norm(h, delta, weight, eps):
    from ft.engine import fused_triton

    out_h, out_x = torch.empty_like(h), torch.empty_like(h)
    fused_triton.add_rms_norm(h, delta, weight, out_h, out_x, eps)
    return out_h, out_x


def _triton_qk_norm_rope(qk, weight, cos, sin, eps):
    from ft.engine import fused_triton

    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)  # contiguous
    fused_triton.qk_norm_rope(qk, weight, cos, sin, out, eps)
    return out


def route_topk(logits, top_k: int, norm: bool, dtype, backend: str = "torch"):
    """Softmax top-k of router logits [T, E] -> ids [T, K] int64, weights [T, K] in `dtype`
    (softmax and the renormalisation in float32)."""
    if backend == "triton":
        from ft.engine import fused_triton

        ids = torch.empty(logits.shape[0], top_k, dtype=torch.long, device=logits.device)
        weights = torch.empty(ids.shape, dtype=dtype, device=logits.device)
        fused_triton.route_topk(logits, top_k, norm, ids, weights)
        return ids, weights
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)
