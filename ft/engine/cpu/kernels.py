"""CPU kernels for experts: out[t, r - r0] = sum_j W[r, c0 + j] * x[t, j] for rows r0..r1 of one
projection, read straight from its codes and scales (quantised formats) or its bf16 / float32
weights: no dequantised copy of the block, float32 arithmetic throughout. The pool's row-block
task path calls them (ExpertFormat.rows_dot); its default path, the layer kernel, decodes rows
itself (ft.engine.cpu.layer_kernel).

They are compiled by numba once (cached on disk) and release the GIL, so the pool's threads run
them side by side; torch's path (dequantise a block with tensor ops, then a matmul) holds the GIL
between its many small ops and measured 4 to 15 times slower on one core.

Each row is decoded once into float32 (int8 and bf16 by a vectorised convert or shift; e4m3 and
e2m1 by a lookup per code in a 256- or 16-entry table), then dotted with every token's x
(vectorised).
Legend: n = tokens, R = rows of the projection, C = its columns, cols = columns in x.
"""

from __future__ import annotations

import numpy as np

from ft.engine.cpu.jit import jit


@jit(fastmath=True)
def _dot_rows(w, x, out, col):
    """out[t, col] = w . x[t] for every token: the vectorised half of each kernel."""
    for t in range(x.shape[0]):
        xt = x[t]
        acc = np.float32(0.0)
        for j in range(w.shape[0]):
            acc += w[j] * xt[j]
        out[t, col] = acc


@jit(fastmath=True)
def float_rows(x, weights, r0, r1, c0, out):
    """W = weights, float32 [R, C]: no decoding."""
    cols = x.shape[1]
    for r in range(r0, r1):
        _dot_rows(weights[r, c0 : c0 + cols], x, out, r - r0)


@jit(fastmath=True)
def bf16_rows(x, bits16, r0, r1, c0, out):
    """W = bfloat16 weights, as their uint16 bits [R, C]: a bf16 is the top half of a float32."""
    cols = x.shape[1]
    bits = np.empty(cols, np.uint32)
    w = bits.view(np.float32)
    for r in range(r0, r1):
        row = bits16[r, c0 : c0 + cols]
        for j in range(cols):
            bits[j] = np.uint32(row[j]) << 16
        _dot_rows(w, x, out, r - r0)


@jit(fastmath=True)
def int8_rows(x, codes, r0, r1, c0, row_scale, out):
    """W[r, c] = codes[r, c] * row_scale[r - r0]; codes int8 [R, C]."""
    cols = x.shape[1]
    w = np.empty(cols, np.float32)
    for r in range(r0, r1):
        row = codes[r, c0 : c0 + cols]  # a slice, not an offset index: then the loops vectorise
        scale = row_scale[r - r0]
        for j in range(cols):
            w[j] = np.float32(row[j]) * scale
        _dot_rows(w, x, out, r - r0)


@jit(fastmath=True)
def table_rows(x, codes, table, r0, r1, c0, scales, scale_row, group, out):
    """W[r, c] = table[codes[r, c]] * scales[scale_row[r - r0], c // group]; codes uint8 [R, C]
    (fp8_block: e4m3 bytes, 128 x 128 scale blocks). c0 need not be a multiple of group."""
    cols = x.shape[1]
    w = np.empty(cols, np.float32)
    for r in range(r0, r1):
        row = codes[r, c0 : c0 + cols]
        srow = scales[scale_row[r - r0]]
        j = 0
        while j < cols:  # decoded once per row, whatever the tokens; one scale group at a time
            g = (c0 + j) // group
            end = min(cols, (g + 1) * group - c0)
            scale = srow[g]
            for k in range(j, end):
                w[k] = table[row[k]] * scale
            j = end
        _dot_rows(w, x, out, r - r0)


@jit(fastmath=True)
def nvfp4_rows(x, packed, table, r0, r1, c0, scales, scale_table, row_scale2, out):
    """W[r, c] = table[e2m1 code c of row r] * scale_table[scales[r, c // 16]] * row_scale2[r - r0];
    packed uint8 [R, C/2], two codes a byte (element 2j in the low nibble); scales uint8 (e4m3)
    [R, C/16]. c0 and cols are multiples of 16."""
    cols = x.shape[1]
    first, groups = c0 // 16, cols // 16
    w = np.empty(cols, np.float32)
    for r in range(r0, r1):
        row = packed[r, first * 8 : (first + groups) * 8]
        srow = scales[r, first : first + groups]
        for g in range(groups):
            scale = scale_table[srow[g]] * row_scale2[r - r0]
            for j in range(8):
                b = row[g * 8 + j]
                w[g * 16 + 2 * j] = table[b & 15] * scale
                w[g * 16 + 2 * j + 1] = table[b >> 4] * scale
        _dot_rows(w, x, out, r - r0)


@jit(fastmath=True)
def bf16_ffn_block(x, w13, w2, lo, hi, inter, scale, rows, acc):
    """acc[rows[t]] += scale[t] * (down[:, lo:hi] @ (silu(gate[lo:hi] x_t) * up[lo:hi] x_t)) for
    each of the n tokens: one block [lo, hi) of I of a bf16 expert's FFN in ONE call, so a CPU
    MoE task releases the GIL once (a task of several torch ops hands the GIL back and forth at
    each of them: 15 threads on one expert ran ~2x slower than one).
    x [n, D] float32; w13 [2I, D], w2 [D, I] the bf16 weights' uint16 bits; scale [n]
    float32; rows [n] int64 into acc [T, D] float32."""
    n, s = x.shape[0], hi - lo
    gate = np.empty((n, s), np.float32)
    up = np.empty((n, s), np.float32)
    bf16_rows(x, w13, lo, hi, 0, gate)
    bf16_rows(x, w13, inter + lo, inter + hi, 0, up)
    for t in range(n):
        for j in range(s):
            a = gate[t, j]
            gate[t, j] = a / (np.float32(1.0) + np.exp(-a)) * up[t, j] * scale[t]
    y = np.empty((n, w2.shape[0]), np.float32)
    bf16_rows(gate, w2, 0, w2.shape[0], lo, y)
    for t in range(n):
        acc[rows[t]] += y[t]


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel for the argument types the pool passes,
    so the first decode step does not pay for it."""
    x, out = np.ones((1, 16), np.float32), np.empty((1, 1), np.float32)
    one, row = np.ones(1, np.float32), np.zeros(1, np.int64)
    float_rows(x, np.ones((1, 16), np.float32), 0, 1, 0, out)
    bf16_rows(x, np.zeros((1, 16), np.uint16), 0, 1, 0, out)
    bf16_ffn_block(x, np.zeros((2, 16), np.uint16), np.zeros((16, 1), np.uint16), 0, 1, 1, one,
                   row, np.zeros((1, 16), np.float32))  # fmt: skip
    int8_rows(x, np.zeros((1, 16), np.int8), 0, 1, 0, one, out)
    table_rows(x, np.zeros((1, 16), np.uint8), np.ones(256, np.float32), 0, 1, 0,
               np.ones((1, 1), np.float32), row, 128, out)  # fmt: skip
    nvfp4_rows(x, np.zeros((1, 8), np.uint8), np.ones(16, np.float32), 0, 1, 0,
               np.zeros((1, 1), np.uint8), np.ones(256, np.float32), one, out)  # fmt: skip
