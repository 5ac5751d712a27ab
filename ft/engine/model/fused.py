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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [T, N, d], cos/sin [T, 1, d] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def add_rms_norm(h, delta, weight, eps: float, backend: str = "torch", out=None):
    """-> (h + delta, RMSNorm(h + delta)); delta None: h unchanged. h, delta [T, D]. out: the
    two [T, D] tensors to write them into (a decode stretch's handoff buffers)."""
    if backend == "triton" and delta is not None:
        return _triton_add_rms_norm(h, delta, weight, eps, out)
    if delta is not None:
        h = h + delta
    x = rms_norm(h, weight, eps)
    if out is None:
        return h, x
    out[0].copy_(h)
    out[1].copy_(x)
    return out


def qk_norm_rope(qk, weight, rope, positions, eps: float, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over d (weight [N, d], None: no norm) then RoPE at `positions` [T] (`rope`: an
    attention.Rope), for qk [T, N, d] -> [T, N, d]. The Triton kernel gathers the tables' rows
    itself; torch gathers them once per forward (Rope.tables)."""
    if backend == "triton" and weight is not None:
        return _triton_qk_norm_rope(qk, weight, rope.cos, rope.sin, positions, eps)
    cos, sin = rope.tables(positions, qk.dtype)
    if weight is not None:
        qk = rms_norm(qk, weight, eps)
    return rotate(qk, cos, sin)


def _triton_add_rms_norm(h, delta, weight, eps, out=None):
    from ft.engine.kernels import fused as fused_triton

    out_h, out_x = out if out is not None else (torch.empty_like(h), torch.empty_like(h))
    fused_triton.add_rms_norm(h, delta, weight, out_h, out_x, eps)
    return out_h, out_x


def _triton_qk_norm_rope(qk, weight, cos, sin, positions, eps):
    from ft.engine.kernels import fused as fused_triton

    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)  # contiguous
    fused_triton.qk_norm_rope(qk, weight, cos, sin, positions, out, eps)
    return out


def route_topk(
    logits, top_k: int, norm: bool, dtype, backend: str = "torch", routers=1, out=None,
    mirror=None,
):  # fmt: skip
    """Softmax top-k of router logits [T, routers * E] (`routers` routers side by side, each
    picked in turn) -> ids [T, routers * K] int64, the first router's weights [T, K] in `dtype`
    (softmax and the renormalisation in float32). out: (ids, weights) to write into; ids' rows
    may be longer (a handoff's stop columns). mirror: [T, >= routers * K] int64, where the ids
    are also written (pinned rows the host reads: graphs.StopRows)."""
    T = logits.shape[0]  # noqa: N806
    if backend == "triton":
        from ft.engine.kernels import fused as fused_triton

        if out is None:
            ids = torch.empty(T, routers * top_k, dtype=torch.long, device=logits.device)
            out = (ids, torch.empty(T, top_k, dtype=dtype, device=logits.device))
        fused_triton.route_topk(logits, top_k, norm, *out, routers, mirror)
        return out
    probs = F.softmax(logits.view(T, routers, -1), dim=-1, dtype=torch.float32)  # [T, R, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, weights = ids.view(T, routers * top_k), weights[:, 0].to(dtype)
    if mirror is not None:
        mirror[:, : ids.shape[1]].copy_(ids)
    if out is None:
        return ids, weights
    out[0][:, : ids.shape[1]].copy_(ids)
    out[1].copy_(weights)
    return out
