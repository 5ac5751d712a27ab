"""Triton kernels of the batched expert compute (see grouped.py for the PairBlocks work list).

Two launches per layer, whatever the number of experts:
  1. gate/up: h[p] = silu(x[tok[p]] @ gate_s.T) * (x[tok[p]] @ up_s.T), gate and up read from
     the same w13 slot in one pass, SiLU * mul fused, h kept in float32;
  2. down: y[p] = weight[p] * (h[p] @ down_s.T), float32.
Each program owns one block (pair rows of one slot) and one column tile, so every weight byte
of a slot is read once per block. Rows of other slots or past the end are masked, never early
returns, so the kernels compile the same on every Triton version. Under TRITON_INTERPRET=1 they
run on CPU tensors (tests).

Legend: P = pairs, NB = blocks, D = hidden, I = expert intermediate, BM/BN/BK = tile sizes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Decode is memory-bound: narrow column tiles give enough programs to cover the SMs at batch 1.
GATE_UP_TILES = dict(BN=32, BK=128)
DOWN_TILES = dict(BN=64, BK=64)
# Triton's interpreter (3.9) computes bf16 tl.dot wrong; under it, dots run in float32.
DOT_F32 = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
    if F32:  # resolved at compile time
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _rows(tok_ptr, slot_ptr, bstart_ptr, bslot_ptr, b, P, BM: tl.constexpr):
    """This block's pair rows, their tokens, the block's slot and which rows are live."""
    slot = tl.load(bslot_ptr + b)
    rows = tl.load(bstart_ptr + b) + tl.arange(0, BM)
    row_slot = tl.load(slot_ptr + rows, mask=rows < P, other=-1)
    live = (rows < P) & (row_slot == slot) & (row_slot >= 0)  # slot -1: a dead block
    tok = tl.load(tok_ptr + rows, mask=live, other=0)
    return rows, tok, tl.maximum(slot, 0).to(tl.int64), live


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, tok_ptr, slot_ptr, bstart_ptr, bslot_ptr,
    P, D, INTER, stride_x, stride_ws, stride_wr, stride_h,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    rows, tok, slot, live = _rows(tok_ptr, slot_ptr, bstart_ptr, bslot_ptr, tl.program_id(0), P, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] over I
    col_ok = cols < INTER * tl.max(live.to(tl.int32), 0)  # a dead block reads no weights
    w_base = w13_ptr + slot * stride_ws
    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < D
        xt = tl.load(
            x_ptr + tok[:, None] * stride_x + ks[None, :],
            mask=live[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wr + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(
            w_base + (cols[None, :] + INTER) * stride_wr + ks[:, None], mask=w_mask, other=0.0
        )  # [BK, BN]
        acc_gate += _dot(xt, w_gate, PREC, F32)
        acc_up += _dot(xt, w_up, PREC, F32)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=live[:, None] & col_ok[None, :]
    )


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, y_ptr, weight_ptr, tok_ptr, slot_ptr, bstart_ptr, bslot_ptr,
    P, D, INTER, stride_h, stride_ws, stride_wr, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    rows, tok, slot, live = _rows(tok_ptr, slot_ptr, bstart_ptr, bslot_ptr, tl.program_id(0), P, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] over D
    col_ok = cols < D * tl.max(live.to(tl.int32), 0)
    w_base = w2_ptr + slot * stride_ws
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < INTER
        ht = tl.load(
            h_ptr + rows[:, None] * stride_h + ks[None, :],
            mask=live[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK] float32
        wt = tl.load(
            w_base + cols[None, :] * stride_wr + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [BK, BN]
        acc += _dot(ht.to(wt.dtype), wt, PREC, F32)
    weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + rows[:, None] * stride_y + cols[None, :],
        acc * weight[:, None],
        mask=live[:, None] & col_ok[None, :],
    )


def triton_moe_pairs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, blocks) -> torch.Tensor:
    """-> y [P, D] float32 (0 on rows no live block covers). Two kernel launches."""
    P, D = blocks.num_pairs, x.shape[1]  # noqa: N806
    inter, nb, bm = w2.shape[2], blocks.block_start.shape[0], blocks.block_m
    x = x.contiguous()
    h = torch.empty(P, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(P, D, dtype=torch.float32, device=x.device)
    exact = DOT_F32 or x.dtype == torch.float32  # fp32 models stay fp32 (no tf32)
    prec = "ieee" if exact else "tf32"
    meta = (blocks.tok, blocks.slot, blocks.block_start, blocks.block_slot)
    gu = GATE_UP_TILES
    _gate_up_kernel[(nb, triton.cdiv(inter, gu["BN"]))](
        x, w13, h, *meta, P, D, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BM=bm, PREC=prec, F32=DOT_F32, **gu,
    )  # fmt: skip
    dn = DOWN_TILES
    _down_kernel[(nb, triton.cdiv(D, dn["BN"]))](
        h, w2, y, blocks.weight, *meta, P, D, inter, h.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), BM=bm, PREC=prec, F32=DOT_F32, **dn,
    )  # fmt: skip
    return y
