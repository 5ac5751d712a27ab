"""Triton kernels behind ft.engine.fused (CUDA; under TRITON_INTERPRET=1 on CPU tensors, tests).

`_round` casts to the model's dtype and back, so every step rounds where torch's ops would.
Legend: T = tokens, D = hidden, N = heads, d = head_dim.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, out_h_ptr, out_x_ptr, D, stride_h, stride_d, eps,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    s = _round(h + d, DTYPE)  # the residual stream, in the model's dtype
    tl.store(out_h_ptr + row * D + cols, s.to(DTYPE), mask=ok)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_x_ptr + row * D + cols, (w * _round(s * inv, DTYPE)).to(DTYPE), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, N, stride_xt, stride_xn, stride_c, eps,
    HALF: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    t, n = tl.program_id(0), tl.program_id(1)
    lo = tl.arange(0, HALF)
    base = x_ptr + t * stride_xt + n * stride_xn
    x1 = tl.load(base + lo).to(tl.float32)  # first half of the head
    x2 = tl.load(base + HALF + lo).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + n * 2 * HALF + lo).to(tl.float32)
    w2 = tl.load(w_ptr + n * 2 * HALF + HALF + lo).to(tl.float32)
    y1 = _round(w1 * _round(x1 * inv, DTYPE), DTYPE)
    y2 = _round(w2 * _round(x2 * inv, DTYPE), DTYPE)
    c1 = tl.load(cos_ptr + t * stride_c + lo).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + lo).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + lo).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + lo).to(tl.float32)
    o1 = _round(y1 * c1, DTYPE) + _round(-y2 * s1, DTYPE)  # x * cos + rotate_half(x) * sin
    o2 = _round(y2 * c2, DTYPE) + _round(y1 * s2, DTYPE)
    out = out_ptr + (t * N + n) * 2 * HALF
    tl.store(out + lo, o1.to(DTYPE))
    tl.store(out + HALF + lo, o2.to(DTYPE))


_DTYPES = {"torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16, "torch.float32": tl.float32}


def add_rms_norm(h, delta, weight, out_h, out_x, eps: float) -> None:
    """out_h = h + delta, out_x = RMSNorm(out_h) * weight; h, delta [T, D] (rows may be strided)."""
    T, D = h.shape  # noqa: N806
    _add_rms_norm_kernel[(T,)](
        h, delta, weight, out_h, out_x, D, h.stride(0), delta.stride(0), eps,
        BLOCK=triton.next_power_of_2(D), DTYPE=_DTYPES[str(h.dtype)],
    )  # fmt: skip


def qk_norm_rope(x, weight, cos, sin, out, eps: float) -> None:
    """out [T, N, d] = RoPE(RMSNorm(x) * weight); x [T, N, d] with unit stride over d, weight
    [N, d], cos/sin [T, 1, d]. d must be a power of two (128 in every preset)."""
    T, N, d = x.shape  # noqa: N806
    _qk_norm_rope_kernel[(T, N)](
        x, weight, cos, sin, out, N, x.stride(0), x.stride(1), cos.stride(0), eps,
        HALF=d // 2, DTYPE=_DTYPES[str(x.dtype)],
    )  # fmt: skip
