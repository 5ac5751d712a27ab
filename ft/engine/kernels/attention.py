"""Decode attention in one Triton launch (FT_DECODE_ATTENTION=triton): store this step's k/v in
the KV cache and attend, where the torch path takes ~20 launches a layer (two index_put writes,
two gathers of the whole key range, transposes, a mask, SDPA).

Each program owns one sequence and one KV head, with its R = H/G query heads padded to RP >= 16
rows (tl.dot needs 16 at least). It reads its slot and position from device tensors, so CUDA
graphs replay it for any length: the key loop's bound is the loaded position, no kv_len bucket.

    keys [0, pos) from the cache, BN at a time (online softmax, float32 running max/sum/acc)
    the new key (position pos) from registers: the program's own store is not ordered before
    its loads without a barrier, so it never reads back what it just wrote

Legend: B = sequences, H = query heads, G = kv heads, R = H/G, RP = R padded, d = head_dim,
S = cache slots, M = max_model_len, BN = keys per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.engine.kernels.moe import DOT_F32, _dot

BLOCK_N = 64  # keys per block: [64, 128] bf16 K and V tiles, 16 KiB each


@triton.jit
def _attend_block(
    q, kc, vc, cols, start, pos, stride_cm, m, s_sum, acc, scale,
    BN: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """Fold cache keys [start, start + BN) (those < pos) into the running (m, s_sum, acc)."""
    keys = start + tl.arange(0, BN)
    ok = keys < pos
    offs = keys[:, None] * stride_cm + cols[None, :]  # [BN, d]
    k = tl.load(kc + offs, mask=ok[:, None], other=0.0)
    s = _dot(q, tl.trans(k), PREC, F32) * scale  # [RP, BN] float32
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # m is finite: the new key's score seeds it
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(vc + offs, mask=ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, F32)  # p rounded as flash attn
    return m_new, s_sum * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_attention_kernel(
    q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_knb, stride_kng, stride_vnb, stride_vng,
    stride_cs, stride_cm, stride_cg, stride_ob,
    R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    b, g = tl.program_id(0), tl.program_id(1)
    slot, pos = tl.load(slots_ptr + b), tl.load(pos_ptr + b)  # int64 scalars
    rows, cols = tl.arange(0, RP), tl.arange(0, D)
    live = rows < R  # rows past R pad the group to RP
    heads = g * R + rows
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                mask=live[:, None], other=0.0)  # [RP, d]  # fmt: skip
    k_new = tl.load(kn_ptr + b * stride_knb + g * stride_kng + cols)  # [d]
    v_new = tl.load(vn_ptr + b * stride_vnb + g * stride_vng + cols)
    cache = slot * stride_cs + g * stride_cg
    tl.store(kc_ptr + cache + pos * stride_cm + cols, k_new)
    tl.store(vc_ptr + cache + pos * stride_cm + cols, v_new)
    # the new key first: its score seeds the running max, its weight exp(0) = 1
    m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # [RP]
    s_sum = tl.full((RP,), 1.0, tl.float32)
    acc = tl.zeros((RP, D), tl.float32) + v_new.to(tl.float32)[None, :]  # [RP, d]
    for start in range(0, pos, BN):  # a runtime bound: one compiled kernel for every length
        m, s_sum, acc = _attend_block(
            q, kc_ptr + cache, vc_ptr + cache, cols, start, pos, stride_cm, m, s_sum, acc,
            scale, BN, PREC, F32,
        )  # fmt: skip
    out = acc / s_sum[:, None]
    dst = out_ptr + b * stride_ob + heads[:, None] * D + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def decode_attention(q, k_new, v_new, k_cache, v_cache, slots, positions, out, scale: float,
                     block_n: int = BLOCK_N) -> None:  # fmt: skip
    """out [B, H*d] = attention of q [B, H, d] over each sequence's cached keys [0, pos) and
    k_new/v_new [B, G, d], which are stored into k_cache/v_cache [S, M, G, d] at (slot, pos).
    slots, positions: [B] int64 on the device (never read on the host: graph-safe). q, k_new,
    v_new may be strided views with unit stride over d; the caches share one layout. d must be a
    power of two >= 16, H a multiple of G."""
    B, H, d = q.shape  # noqa: N806
    G = k_new.shape[1]  # noqa: N806
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == k_new.stride(-1) == v_new.stride(-1) == 1
    exact = DOT_F32 or q.dtype == torch.float32  # fp32 models stay fp32 (no tf32)
    _decode_attention_kernel[(B, G)](
        q, k_new, v_new, k_cache, v_cache, slots, positions, out, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        R=H // G, RP=max(16, triton.next_power_of_2(H // G)), D=d, BN=block_n,
        PREC="ieee" if exact else "tf32", F32=DOT_F32,
    )  # fmt: skip
