"""Triton kernels of the batched expert compute (see grouped.py for the PairBlocks work list).

Two launches per layer, whatever the number of experts:
  1. gate/up: h[p] = silu(x[tok[p]] @ gate_s.T) * (x[tok[p]] @ up_s.T), gate and up read from
     the same w13 slot in one pass, SiLU * mul fused, h kept in float32;
  2. down: y[p] = weight[p] * (h[p] @ down_s.T), float32.
Each program owns one block (pair rows of one slot) and one column tile, so every weight byte
of a slot is read once per block. Rows of other slots or past the end are masked, never early
returns, so the kernels compile the same on every Triton version. Under TRITON_INTERPRET=1 they
run on CPU tensors (tests).

Quantised banks (layouts: the expert formats contract, issue 8) are dequantised in registers,
one K-chunk at a time: the codes are loaded as stored (int8, float8_e4m3fn, packed e2m1 nibbles),
converted to the compute dtype *exactly* (int8, e4m3 and e2m1 * e4m3 all fit bf16/fp16), and
every float32 scale that is constant along the tile's K goes on the float32 dot result instead
of the [BK, BN] tile (cheaper, and no rounding of the scaled weight):
  int8       per row: on the accumulator once, after the K loop;
  fp8_block  per 128x128 block: on each chunk's dot (BK divides 128: one block column a chunk);
  nvfp4      e4m3 per 16 along K: on the codes (it varies inside a chunk); fp32 global per
             tensor half: on the accumulator after the loop.
The format is a constexpr, so each one compiles its own specialisation; bf16 does no extra work.

Legend: P = pairs, NB = blocks, D = hidden, I = expert intermediate, BM/BN/BK = tile sizes,
N = slots.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.errors import FtError

# Decode is memory-bound: narrow column tiles give enough programs to cover the SMs at batch 1
# (8 blocks x I/32 = 192 gate/up programs at H=2048, I=768). BK sets the bytes read per row
# per chunk: 128 B for bf16/int8/fp8 (BK 64/128), 128 B for nvfp4 (BK 256 = 128 packed bytes).
# Constraints: fp8_block needs 128 % BK == 0; nvfp4 needs BK % 32 == 0 (two K/2 dots of >= 16).
TILES = {  # fmt -> (gate/up tiles, down tiles); scripts/bench_moe_kernels.py --sweep tunes them
    "bf16": (dict(BN=32, BK=128), dict(BN=64, BK=128)),
    "int8": (dict(BN=32, BK=128), dict(BN=64, BK=128)),
    "fp8_block": (dict(BN=32, BK=128), dict(BN=64, BK=128)),
    "nvfp4": (dict(BN=32, BK=256), dict(BN=32, BK=256)),
}
# fmt -> suffixes of each weight's scale parts in a bank ("w13" + "_scale", ...)
SCALES = {
    "bf16": (),
    "int8": ("_scale",),
    "fp8_block": ("_scale",),
    "nvfp4": ("_scale", "_scale_2"),
}
# Triton's interpreter (3.9) computes bf16 tl.dot (and int -> bf16 casts) wrong; under it, dots
# run in float32.
DOT_F32 = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
def _act(a_ptr, a_rows, stride_a, a_ok, ks, k_ok, CDT: tl.constexpr):
    """[BM, len(ks)] activations (x or h) at columns ks, in the compute dtype."""
    a = tl.load(
        a_ptr + a_rows[:, None] * stride_a + ks[None, :],
        mask=a_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    return a.to(CDT)


@triton.jit
def _e2m1_pair(b):
    """Packed bytes (int32, 0..255) -> (element 2j, element 2j+1) as float32 times 2**-14, exact.
    Each e2m1 code (sign, 2 exponent bits, 1 mantissa bit) is moved into the float16 bit
    positions (sign 15, exponent 10.., mantissa 9): a float16 with exponent bias 15 where e2m1's
    is 1, so 2**-14 times the value, subnormals (codes 0, 1) included."""
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _srow(cols, HALF: tl.constexpr, INTER, FMT: tl.constexpr):
    """Scale row of weight rows HALF * I + cols: the 128-row block row for fp8_block (gate's block
    rows, then up's), else the row itself."""
    if FMT == "fp8_block":
        srow = HALF * ((INTER + 127) // 128) + cols // 128
    else:
        srow = HALF * INTER + cols
    return srow


@triton.jit
def _chunk(
    a_ptr, a_rows, stride_a, a_ok, w_ptr, wrow, stride_wr, s_ptr, srow, stride_sr, col_ok, k0, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, CDT: tl.constexpr,
    PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    """[BM, BN] float32: activations[:, k0:k0+BK] @ w[wrow, k0:k0+BK].T, the chunk's own scales
    applied (none for bf16/int8; the block's for fp8_block; the e4m3 group scales for nvfp4)."""
    if FMT == "nvfp4":  # byte j holds K elements 2j (low nibble) and 2j+1 (high nibble)
        kb = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] byte columns
        kb_ok = kb < K // 2
        w_mask = kb_ok[:, None] & col_ok[None, :]
        codes = tl.load(w_ptr + wrow[None, :] * stride_wr + kb[:, None], mask=w_mask, other=0)
        codes = codes.to(tl.int32)  # [BK/2, BN]
        gs = k0 // 16 + tl.arange(0, BK // 16)  # [BK/16] this chunk's e4m3 scale columns
        g_mask = (gs < K // 16)[:, None] & col_ok[None, :]
        group = tl.load(s_ptr + srow[None, :] * stride_sr + gs[:, None], mask=g_mask, other=0)
        group = group.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BK/16, BN]
        group = tl.reshape(tl.broadcast_to(group[:, None, :], (BK // 16, 8, BN)), (BK // 2, BN))
        lo, hi = _e2m1_pair(codes)  # [BK/2, BN] each; exact in CDT: <= 6 significant bits
        lo = (lo * group).to(CDT)
        hi = (hi * group).to(CDT)
        ks = k0 + tl.arange(0, BK)  # contiguous (vector) loads, split in registers
        a = _act(a_ptr, a_rows, stride_a, a_ok, ks, ks < K, CDT)  # [BM, BK]
        even, odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))  # [BM, BK/2] each
        part = _dot(even, lo, PREC, F32) + _dot(odd, hi, PREC, F32)
    else:
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        w = tl.load(
            w_ptr + wrow[None, :] * stride_wr + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0,
        )  # [BK, BN] as stored; .to below is a no-op for bf16
        a = _act(a_ptr, a_rows, stride_a, a_ok, ks, k_ok, CDT)
        if FMT == "fp8_block":  # e4m3 codes, loaded as uint8 (see _operands)
            w = w.to(tl.float8e4nv, bitcast=True)
        if F32:  # the interpreter (3.9) casts int8 -> bf16 wrong; via float32 it is exact
            w = w.to(tl.float32)
        part = _dot(a, w.to(CDT), PREC, F32)
        if FMT == "fp8_block":  # one block column per chunk (128 % BK == 0)
            scale = tl.load(s_ptr + srow * stride_sr + k0 // 128, mask=col_ok, other=0.0)
            part = part * scale[None, :]
    return part


@triton.jit
def _finish(acc, s_ptr, s2_ptr, srow, stride_sr, col_ok, HALF: tl.constexpr, FMT: tl.constexpr):
    """The scales constant along K, on the float32 accumulator [BM, BN]."""
    if FMT == "int8":
        acc = acc * tl.load(s_ptr + srow * stride_sr, mask=col_ok, other=0.0)[None, :]
    if FMT == "nvfp4":
        # global scale of this tensor half (gate 0, up 1); 2**14 undoes _e2m1_pair's offset
        acc = acc * (tl.load(s2_ptr + HALF) * 16384.0)
    return acc


@triton.jit
def _bases(w_ptr, s_ptr, s2_ptr, slot, NSLOT, host_w, host_s, host_s2, stride_ws, stride_ss,
           stride_s2):  # fmt: skip
    """The block's expert in the bank: slot < NSLOT is a cache slot; NSLOT + e is expert e of
    the host bank (reads in place), `host_*` element offsets from each bank part to it."""
    in_host = slot >= NSLOT
    e = tl.where(in_host, slot - NSLOT, slot)
    w_base = w_ptr + (e * stride_ws + tl.where(in_host, host_w, 0))
    s_base = s_ptr + (e * stride_ss + tl.where(in_host, host_s, 0))
    s2_base = s2_ptr + (e * stride_s2 + tl.where(in_host, host_s2, 0))
    return w_base, s_base, s2_base


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, tok_ptr, slot_ptr, bstart_ptr, bslot_ptr,
    P, D, INTER, stride_x, stride_ws, stride_wr, stride_ss, stride_sr, stride_s2, stride_h,
    NSLOT, host_w, host_s, host_s2,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, CDT: tl.constexpr,
    PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    rows, tok, slot, live = _rows(tok_ptr, slot_ptr, bstart_ptr, bslot_ptr, tl.program_id(0), P, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] over I
    col_ok = cols < INTER * tl.max(live.to(tl.int32), 0)  # a dead block reads no weights
    w_base, s_base, s2_base = _bases(
        w_ptr, s_ptr, s2_ptr, slot, NSLOT, host_w, host_s, host_s2, stride_ws, stride_ss, stride_s2
    )
    s_gate, s_up = _srow(cols, 0, INTER, FMT), _srow(cols, 1, INTER, FMT)
    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        acc_gate += _chunk(
            x_ptr, tok, stride_x, live, w_base, cols, stride_wr, s_base, s_gate, stride_sr,
            col_ok, k0, D, BM, BN, BK, FMT, CDT, PREC, F32,
        )  # fmt: skip
        acc_up += _chunk(
            x_ptr, tok, stride_x, live, w_base, cols + INTER, stride_wr, s_base, s_up, stride_sr,
            col_ok, k0, D, BM, BN, BK, FMT, CDT, PREC, F32,
        )  # fmt: skip
    acc_gate = _finish(acc_gate, s_base, s2_base, s_gate, stride_sr, col_ok, 0, FMT)
    acc_up = _finish(acc_up, s_base, s2_base, s_up, stride_sr, col_ok, 1, FMT)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=live[:, None] & col_ok[None, :]
    )


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, weight_ptr, tok_ptr, slot_ptr, bstart_ptr, bslot_ptr,
    P, D, INTER, stride_h, stride_ws, stride_wr, stride_ss, stride_sr, stride_s2, stride_y,
    NSLOT, host_w, host_s, host_s2,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, CDT: tl.constexpr,
    PREC: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    rows, tok, slot, live = _rows(tok_ptr, slot_ptr, bstart_ptr, bslot_ptr, tl.program_id(0), P, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] over D
    col_ok = cols < D * tl.max(live.to(tl.int32), 0)
    w_base, s_base, s2_base = _bases(
        w_ptr, s_ptr, s2_ptr, slot, NSLOT, host_w, host_s, host_s2, stride_ws, stride_ss, stride_s2
    )
    srow = _srow(cols, 0, INTER, FMT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        acc += _chunk(
            h_ptr, rows, stride_h, live, w_base, cols, stride_wr, s_base, srow, stride_sr,
            col_ok, k0, INTER, BM, BN, BK, FMT, CDT, PREC, F32,
        )  # fmt: skip
    acc = _finish(acc, s_base, s2_base, srow, stride_sr, col_ok, 0, FMT)
    weight = tl.load(weight_ptr + rows, mask=live, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + rows[:, None] * stride_y + cols[None, :],
        acc * weight[:, None],
        mask=live[:, None] & col_ok[None, :],
    )


def _operands(bank: dict, name: str, fmt: str) -> tuple:
    """-> (w, scale, scale_2, strides): one weight's kernel operands. Parts a format lacks are
    stood in by w (never read: the constexpr format compiles their loads out) with stride 0."""
    missing = [name + s for s in ("", *SCALES[fmt]) if name + s not in bank]
    if missing:
        raise FtError(f"{fmt} expert bank lacks part(s) {', '.join(missing)}")
    w = _as_bytes(bank[name])
    scale, scale_2 = ([_as_bytes(bank[name + s]) for s in SCALES[fmt]] + [w, w])[:2]
    s_strides = (scale.stride(0), scale.stride(1)) if SCALES[fmt] else (0, 0)  # slot, row
    s2_stride = scale_2.stride(0) if fmt == "nvfp4" else 0
    return w, scale, scale_2, (w.stride(0), w.stride(1), *s_strides, s2_stride)


def tiles_for(fmt: str, bm: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(gate/up, down) tiles: TILES, with a shorter K-chunk where that one spills registers
    (ptxas, sm_90): quantised banks under fp32 activations (FMA dots), nvfp4 at BM > 16; and
    wider gate/up tiles for bf16 past 16 pair rows a block (batch 4: 82.9 against 92.5 us a
    layer, in bench_moe_kernels' sweep; at batch 1 they lose, 32.5 against 28.0)."""
    gu, dn = TILES[fmt]
    if fmt == "bf16" and bm > 16:
        gu = dict(BN=64, BK=64)
    if fmt != "bf16" and dtype == torch.float32:
        return {**gu, "BK": 32}, {**dn, "BK": 32}
    if fmt == "nvfp4" and bm > 16:
        return {**gu, "BK": 128}, {**dn, "BK": 128}
    return gu, dn


def _as_bytes(part: torch.Tensor) -> torch.Tensor:
    """float8 parts go in as uint8, bit-cast back in the kernel (free): the interpreter cannot
    fill a masked float8 load's `other`, and the kernel is the same on the GPU."""
    return part.view(torch.uint8) if part.dtype == torch.float8_e4m3fn else part


def _host_offsets(bank: dict, host: dict | None, name: str, fmt: str) -> tuple[int, int, int]:
    """Element offsets from one weight's bank operands (w, scale, scale_2) to the host bank's
    (reads in place; 0 without one): the kernels add them to reach expert e in place. The
    two banks must lay an expert out alike (same strides past the leading one)."""
    if host is None:
        return 0, 0, 0
    offsets = []
    for suffix in ("", *SCALES[fmt]):
        part, far = _as_bytes(bank[name + suffix]), _as_bytes(host[name + suffix])
        if part.stride() != far.stride() or part.dtype != far.dtype:
            raise FtError(f"host bank part {name + suffix} is laid out unlike the cache's")
        gap = far.data_ptr() - part.data_ptr()
        assert gap % part.element_size() == 0, "banks are aligned to their elements"
        offsets.append(gap // part.element_size())
    return tuple(offsets + [0, 0])[:3]  # type: ignore[return-value]


def triton_moe_pairs(x: torch.Tensor, bank: dict, blocks, fmt: str, host=None) -> torch.Tensor:
    """-> y [P, D] float32 (rows no live block covers are left unwritten). Two kernel launches.
    bank: part name -> [N, ...] per the contract ("w13", "w2" and the format's scales); host
    (reads in place): the same parts [E, ...] in pinned host memory, which slot N + e reads
    in place."""
    if fmt not in TILES:
        raise FtError(f"unknown expert format {fmt!r} (one of {', '.join(TILES)})")
    w13, s13, s2_13, strides13 = _operands(bank, "w13", fmt)
    w2, s2, s2_2, strides2 = _operands(bank, "w2", fmt)
    nslot = w13.shape[0]
    host13, host2 = (_host_offsets(bank, host, n, fmt) for n in ("w13", "w2"))
    P, D = blocks.num_pairs, x.shape[1]  # noqa: N806
    inter, nb, bm = w13.shape[1] // 2, blocks.block_start.shape[0], blocks.block_m
    x = x.contiguous()
    h = torch.empty(P, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(P, D, dtype=torch.float32, device=x.device)  # dead rows: never read
    exact = DOT_F32 or x.dtype == torch.float32  # fp32 models stay fp32 (no tf32)
    cdt = _TL_DTYPE[w13.dtype if fmt == "bf16" else x.dtype]  # bf16: as today, the bank's dtype
    const = dict(BM=bm, FMT=fmt, CDT=cdt, PREC="ieee" if exact else "tf32", F32=DOT_F32)
    meta = (blocks.tok, blocks.slot, blocks.block_start, blocks.block_slot)
    gu, dn = tiles_for(fmt, bm, x.dtype)
    _gate_up_kernel[(nb, triton.cdiv(inter, gu["BN"]))](
        x, w13, s13, s2_13, h, *meta, P, D, inter, x.stride(0), *strides13, h.stride(0),
        nslot, *host13, **const, **gu,
    )  # fmt: skip
    _down_kernel[(nb, triton.cdiv(D, dn["BN"]))](
        h, w2, s2, s2_2, y, blocks.weight, *meta, P, D, inter, h.stride(0), *strides2,
        y.stride(0), nslot, *host2, **const, **dn,
    )  # fmt: skip
    return y


@triton.jit
def _reduce_kernel(
    y_ptr, row_ptr, slot_ptr, out_ptr, share_ptr, shared_ptr, D, stride_y, stride_o,
    K: tl.constexpr, BD: tl.constexpr, DTYPE: tl.constexpr, SHARE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = cols < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for k in tl.static_range(K):  # token t's pairs in routing order: a fixed order of sums
        row = tl.load(row_ptr + t * K + k)
        part = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
        acc += tl.where(tl.load(slot_ptr + row) >= 0, part, 0.0)  # slot -1: not computed
    if SHARE:  # hybrid: the CPU's experts' sum, where the plan found it written
        if tl.load(shared_ptr) != 0:  # volatile: pinned rows the host rewrites between steps
            acc += tl.load(share_ptr + t * D + cols, mask=ok, other=0.0, volatile=True)
    tl.store(out_ptr + t * stride_o + cols, acc.to(DTYPE), mask=ok)


def triton_reduce_pairs(y, row_of, slot, tokens: int, dtype, share=None) -> torch.Tensor:
    """-> [T, D] in `dtype`: token t's K pair rows of y [P, D] (rows row_of[t K : t K + K]),
    those with a slot, summed in float32; one launch where torch takes four (two fills, an
    index_add_ and the cast: ~8 us of a decode layer's kernels at batch 1). share
    (hybrid, grouped.CpuShare): plus its rows [T, D] float32 where its flag is set."""
    P, D = y.shape  # noqa: N806
    out = torch.empty(tokens, D, dtype=dtype, device=y.device)
    bd = min(1024, triton.next_power_of_2(D))
    rows, shared = (y, slot) if share is None else (share.rows, share.shared)  # stand-ins
    _reduce_kernel[(tokens, triton.cdiv(D, bd))](
        y, row_of, slot, out, rows, shared, D, y.stride(0), out.stride(0), K=P // tokens, BD=bd,
        DTYPE=_TL_DTYPE[dtype], SHARE=share is not None,
    )  # fmt: skip
    return out
