"""The CPU MoE pool's layer kernel: one nopython call per worker serves every layer call.

Each pinned worker enters `serve` once and stays in compiled code (GIL released) for the pool's
life: it waits for the caller to publish a call (spin, then futex), computes its share, counts
itself done, and waits again. No Python runs per call, per expert or per row on the workers.

A call is a plan (int64 words, below) for the k experts of one layer's CPU share. Its work is
cut into units of contiguous rows, each worker claiming its own range of units first and then
what is left of the others' (_claim):
  phase 1: a unit is rows [i0, i1) of I of one expert: gate row i and up row I + i of w13 (each
           a contiguous row of D), act[token, i] = silu(gate . x) * (up . x) * weight;
  barrier (the down projection needs every worker's act);
  phase 2: a unit is rows [d0, d1) of D of every expert's w2 (each a contiguous row of I), and
           writes out[:, d0:d1], summed over experts: no partial sums to reduce, no shared
           writes.
On AVX2 hosts without the bf16 dot, bf16 and fp8_block rows are decoded in registers (bf16 by a
shift, e4m3 by F16C) and dotted with up to four float32 tokens a pass (float_dots). Elsewhere a
row's weights are decoded into a float32 buffer in L1 (vectorised: bf16 by a shift, int8 by a
convert, e4m3 by bit arithmetic, e2m1 by vpshufb, 32 at a time), then dotted with each of the
row's tokens in float32. Scales that are constant along a row (int8's per-row scale, nvfp4's
per-tensor scale) multiply the dot product, not the weights.
int8 experts with up to four tokens in the call (INT_DOT_TOKENS), and nvfp4's of up to
NVFP4_INT_TOKENS on AVX2, skip the decode: the tokens' x (and, after the barrier,
their act) is rounded to int8 per block of 32 (llama.cpp's Q8_0), and each weight row is dotted
with every token in one pass, in integer lanes (intrinsics.q8_dot_rows: vpdpbusd, or vpmaddubsw
+ vpmaddwd on AVX2; nvfp4_q8_dot_rows: its codes to integers by vpshufb first;
nvfp4_q8_dot_rows_wide: blocks of 64 codes, one instruction's with AVX512-VNNI, two halves'
on AVX2, against an activation laid out for it once per call by _quantize_wide), times the
block scales and the row's scales.
On AVX512-BF16 hosts every other expert takes the bf16 dot (bf16_dotted): x (and act) is rounded
to bf16 once per call (llama.cpp's vec_dot_type for bf16 weights); a bf16 row is read as it is,
a quantised one is decoded to bf16 into L1 first (exactly; int8 by a convert, e4m3 and e2m1 in
16-bit lanes with vpermw tables), and each row is dotted with up to four tokens in one pass by
vdpbf16ps (intrinsics.bf16_dot_rows), 32 weights an instruction, block and group scales applied
to the products.
The per-row functions are inlined into the call's loops: a numba call with this many array
arguments cost as much as a row's dot from cache.
Legend: T = tokens of the call, D = hidden, I = expert intermediate, n = tokens of one expert.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types
from numba.extending import overload

from ft.engine.cpu.intrinsics import (
    AVX2,
    AVX512BF16,
    AVX512BW,
    BF16_BLOCK,
    DOT_TOKENS,
    E2M1_X2,
    F16C,
    F32_STEP,
    FP8_BLOCK,
    Q8_BLOCK,
    WIDE_BLOCK,
    WIDE_LANE_Q8,
    WIDE_LANES,
    address,
    atomic_add,
    atomic_load,
    bf16_dot_rows,
    bf16_dot_rows_per_16,
    bf16_dot_rows_per_128,
    bf16_f32_dot_rows,
    bits_of_f32,
    current_cpu,
    cycles,
    decode_e2m1,
    decode_e2m1_bf16,
    decode_e4m3,
    decode_int8,
    e4m3_dot_rows,
    e4m3_f32_dot_rows,
    e4m3_value,
    e4m3_values16,
    f32_of_bits,
    nvfp4_q8_dot_rows,
    nvfp4_q8_dot_rows_wide,
    prefetch,
    q8_dot_rows,
    quantize_block,
    wide_layout,
)
from ft.engine.cpu.jit import jit
from ft.engine.cpu.sync import publish, wait_change, wake

# int8 experts with at most this many tokens in a call dot integers (integer_dot), every token
# in one pass over the row (q8_dot_rows): no decode, and fewer instructions per byte than a
# decode to bf16 and its dot (one Zen 4 core, a row of 2048 from L2: T=4 287-331 -> 137-158 ns;
# T=1 46-66 either way). With more tokens the bf16 dot's one decode a row serves them all.
INT_DOT_TOKENS = DOT_TOKENS
# nvfp4 experts with at most this many tokens take the integer dot (the wide one, where a row is
# whole blocks). Where the bf16 dot exists (AVX512-BF16) the integer dot wins up to two tokens:
# 2-core Zen 4, two threads, k=8, alternated twice against the bf16 dot, T=1 9.0-13.3 ->
# 14.8 GB/s, T=2 6.7-9.3 -> 7.2-11.4, T=4 level (5.2-6.8 against 5.0-6.7). Compiled for AVX2
# alone it beats the float path at four: T=4 3.1-3.2 -> 6.8-6.9 GB/s (rows of 2048 from L2:
# 558-761 -> 251-256 ns), T=1 11.9-12.2 -> 12.9-13.7.
NVFP4_INT_TOKENS = 2 if AVX512BF16 else DOT_TOKENS
# Formats the kernel reads (the plan's FMT word).
F32, BF16, INT8, FP8, NVFP4 = 0, 1, 2, 3, 4
NVFP4_GROUP = 16
# fp8_block rows of whole 128-column blocks are decoded in registers and dotted there
# (e4m3_dot_rows), their block scale applied once per 128 columns: vpermw needs AVX512-BW
FUSED_E4M3 = AVX512BW
# e2m1's values by code (sign, 2 exponent bits of bias 1, 1 mantissa bit)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E2M1_INT = np.array(E2M1_X2, np.int32)  # twice E2M1: the integer dot's

# The control block: one word per cache line (sync.control_block), index = word * 8; then each
# worker's claim counters, phase 1's and phase 2's (control_words).
GEN, STOP, PLAN, DONE, BARRIER, WORKER_SLEEPERS, CALLER_SLEEPERS, BARRIER_SLEEPERS = (
    8 * i for i in range(8)
)
CONTROL_WORDS = 8

# The plan: header words, then PARTS words per expert (part addresses, 0 where unused).
(FMT, EXPERTS, TOKENS, HIDDEN, INTER, WORKERS, X, ACT, OUT, TOKEN_START, TOKEN_ROW, TOKEN_WEIGHT,
 STAMPS) = range(13)  # fmt: skip
HEADER, PARTS = 16, 6
# STAMPS: 0, or the address of int64 [WORKERS, STAMP_COUNT] where each worker writes the
# time-stamp counter as it passes each point of its call (ft.engine.cpu.phases reads them)
STARTED, PREPARED, ARRIVED, PASSED, FINISHED = range(5)
STAMP_COUNT = 5
W13, W2, W13_SCALE, W2_SCALE, W13_SCALE_2, W2_SCALE_2 = range(PARTS)

# Each phase's work is cut into units (phase 1: a block of rows of I of one expert; phase 2: a
# block of rows of D, every expert's), about UNITS_PER_WORKER per worker, and each worker owns a
# contiguous range of them: it claims its own units first (its counter stays in its cache),
# then claims the others' left (their counters, in turn), so a worker slowed by its core, its
# memory or a neighbour no longer holds every other at the barrier. A static split held them:
# on the 15-thread H200 box the slowest worker's phase 1 took 1.4-1.6x the median.
UNITS_PER_WORKER = 16
OUT_LINE = 16  # float32 a cache line: phase 2's blocks of D are whole lines of out


def control_words(workers):
    """The control block's words for a pool of `workers`."""
    return CONTROL_WORDS + 2 * workers


@jit(inline="always")
def _counter(phase, worker, workers):
    """The index in the control block of `worker`'s claim counter of phase 1 or 2."""
    return 8 * (CONTROL_WORDS + (phase - 1) * workers + worker)


@jit(inline="always")
def _claim(ctrl, phase, units, worker, workers, victim):
    """The next unit of a phase's `units` for `worker` (worker w owns units [w * units /
    workers, (w + 1) * units / workers), counted by its counter): its own first, then the others'
    in turn from `victim` (0: itself; the offset the last claim found work at, so a thief does
    not count through ranges it found empty). -> (unit, victim), unit -1 when none is left."""
    while victim < workers:
        v = worker + victim
        if v >= workers:
            v -= workers
        lo, hi = v * units // workers, (v + 1) * units // workers
        if hi > lo:
            n = atomic_add(ctrl, _counter(phase, v, workers), 1)
            if lo + n < hi:
                return lo + n, victim
        victim += 1
    return -1, victim


@jit(inline="always")
def _units_left(ctrl, phase, units, workers):
    """Whether any unit of a phase is still unclaimed (claims only ever take more: a False stays
    False for the call)."""
    for v in range(workers):
        lo, hi = v * units // workers, (v + 1) * units // workers
        if lo + atomic_load(ctrl, _counter(phase, v, workers)) < hi:
            return True
    return False


@jit()
def phase_units(plan):
    """(phase 1's rows of I a unit, its units per expert, phase 2's rows of D a unit, its
    units): about UNITS_PER_WORKER units a worker in each phase."""
    k, hidden, inter, workers = plan[EXPERTS], plan[HIDDEN], plan[INTER], plan[WORKERS]
    want = UNITS_PER_WORKER * workers
    per_expert = min(inter, max(1, (want + k - 1) // k))
    rows1 = (inter + per_expert - 1) // per_expert
    rows2 = (hidden + want - 1) // want
    rows2 = (rows2 + OUT_LINE - 1) // OUT_LINE * OUT_LINE
    return rows1, (inter + rows1 - 1) // rows1, rows2, (hidden + rows2 - 1) // rows2


# -- decoding one row into float32 -------------------------------------------------------------


@jit(fastmath=True)
def _decode_bf16(src, buf):
    for j in range(src.shape[0]):
        buf[j] = f32_of_bits(np.uint32(src[j]) << 16)


@jit(fastmath=True)
def _decode_f32(src, buf):
    for j in range(src.shape[0]):
        buf[j] = src[j]


@jit(fastmath=True)
def _decode_int8(src, buf):
    for j in range(src.shape[0]):
        buf[j] = np.float32(src[j])


@jit(fastmath=True)
def _decode_fp8(src, scales, buf):
    """src e4m3 bytes [C]; scales float32 [ceil(C / 128)]: one per block of 128 columns."""
    cols = src.shape[0]
    for blk in range(scales.shape[0]):
        s = scales[blk]
        lo, hi = blk * FP8_BLOCK, min(cols, (blk + 1) * FP8_BLOCK)
        codes, out = src[lo:hi], buf[lo:hi]  # slices, not offset indices: the loop vectorises
        for j in range(hi - lo):
            out[j] = e4m3_value(codes[j]) * s


@jit(fastmath=True)
def _group_scales(scales, groups):
    """groups[g] = nvfp4's e4m3 group scale g, float32: 16 at a time in vector lanes."""
    n = scales.shape[0]
    whole = n - n % 16
    for g in range(0, whole, 16):
        e4m3_values16(scales, groups, g)
    for g in range(whole, n):
        groups[g] = e4m3_value(scales[g])


@jit(fastmath=True)
def _decode_nvfp4(src, scales, groups, buf, cols):
    """buf[:cols] (float32, or uint16 bf16 bits: exact) = the e2m1 codes src [cols / 2] (element
    2j low nibble) times their e4m3 group scales [cols / 16]: whole blocks of 32 by decode_e2m1
    (vpshufb; a table lookup per element ran 10x slower at 4 tokens), a last group here."""
    _group_scales(scales, groups)
    full = cols // Q8_BLOCK
    decode_e2m1(src, groups, buf, full)
    for j in range(full * Q8_BLOCK, cols):
        code = src[j // 2] >> (4 * (j % 2)) & 15
        _put(buf, j, E2M1[code] * groups[j // NVFP4_GROUP])


def _put(buf, j, value):
    """buf[j] = value: float32, or bf16 bits where buf is uint16 (value exact in bf16)."""


@overload(_put)
def _put_typed(buf, j, value):
    if buf.dtype == types.uint16:
        return lambda buf, j, value: _put_bits(buf, j, value)
    return lambda buf, j, value: _put_float(buf, j, value)


@jit()
def _put_bits(buf, j, value):
    buf[j] = np.uint16(bits_of_f32(np.float32(value)) >> np.uint32(16))


@jit()
def _put_float(buf, j, value):
    buf[j] = value


@jit(fastmath=True, inline="always")  # as bf16_dots
def decode_row(fmt, parts, proj, r, cols, inter, buf, groups):
    """buf[:cols] = row r of projection `proj` (W13: [2I, D]; W2: [D, I]) of one expert, in
    float32 up to a factor constant along the row, which it returns."""
    base = parts[proj]
    if fmt == BF16:
        _decode_bf16(carray(address(base + 2 * r * cols), (cols,), np.uint16), buf)
        return np.float32(1.0)
    if fmt == F32:
        _decode_f32(carray(address(base + 4 * r * cols), (cols,), np.float32), buf)
        return np.float32(1.0)
    if fmt == INT8:
        _decode_int8(carray(address(base + r * cols), (cols,), np.int8), buf)
        return _row_scale(parts, proj, r)
    if fmt == FP8:
        scales = _fp8_scales(parts, proj, r, cols, inter)
        _decode_fp8(carray(address(base + r * cols), (cols,), np.uint8), scales, buf)
        return np.float32(1.0)
    return _decode_nvfp4_row(parts, proj, r, cols, inter, buf, groups)


@jit(fastmath=True)
def _decode_nvfp4_row(parts, proj, r, cols, inter, buf, groups):
    """buf[:cols] = row r of nvfp4 projection `proj` but for its tensor scale, returned."""
    codes, scales = _nvfp4_row(parts, proj, r, cols)
    _decode_nvfp4(codes, scales, groups, buf, cols)
    return _nvfp4_tensor_scale(parts, proj, r, inter)


@jit(inline="always")
def _row_scale(parts, proj, r):
    """The scale of row r of int8 projection `proj`."""
    return carray(address(parts[proj + 2] + 4 * r), (1,), np.float32)[0]


@jit(inline="always")
def _nvfp4_row(parts, proj, r, cols):
    """Row r of nvfp4 projection `proj`: (codes [cols / 2], two a byte; e4m3 group scales
    [cols / 16])."""
    ngroups = cols // NVFP4_GROUP
    codes = carray(address(parts[proj] + r * (cols // 2)), (cols // 2,), np.uint8)
    return codes, carray(address(parts[proj + 2] + r * ngroups), (ngroups,), np.uint8)


@jit(inline="always")
def _nvfp4_tensor_scale(parts, proj, r, inter):
    """The tensor scale of row r of nvfp4 projection `proj` (w13_scale_2: gate's, then up's)."""
    which = r // inter if proj == W13 else 0
    return carray(address(parts[proj + 4] + 4 * which), (1,), np.float32)[0]


@jit(fastmath=True)
def _dot(w, v, cols):
    acc = np.float32(0.0)
    for j in range(cols):
        acc += w[j] * v[j]
    return acc


# -- int8: integer dots against activations quantised per block of 32 --------------------------


@jit(fastmath=True)
def _amax(v):
    m = np.float32(0.0)
    for j in range(v.shape[0]):
        m = max(m, abs(v[j]))
    return m


# IEEE (fastmath=False: numba passes a fastmath caller's flag on to callees that set none): d =
# amax / 127 and v / d exactly, as quantize_block, not by reciprocals, so that a reference can
# round alike (ft.engine.cpu.layer.q8_0)
@jit(fastmath=False)
def _round_q8(v, q, amax):
    d = amax / np.float32(127.0)
    if d > 0:
        for j in range(v.shape[0]):
            q[j] = np.int8(np.rint(v[j] / d))
    else:
        q[:] = 0
    return d


@jit(fastmath=False)  # as _round_q8
def _quantize_q8(v, q, s):
    """q[:n] int8 codes, s[ceil(n / 32)] float32 scales: v [n] as llama.cpp's Q8_0, each block of
    32 elements q = rint(v / d), d = amax(block) / 127 (an all-zero block: d = 0, q = 0). The
    error per element is at most d / 2 = amax(block) / 254. Whole blocks by quantize_block (in
    vector lanes), a last partial one here."""
    full = v.shape[0] // Q8_BLOCK
    for b in range(full):
        s[b] = quantize_block(v, b * Q8_BLOCK, q, b * Q8_BLOCK)
    if full < s.shape[0]:
        tail = full * Q8_BLOCK
        s[full] = _round_q8(v[tail:], q[tail:], _amax(v[tail:]))


@jit(fastmath=False)  # as _round_q8
def _quantize_wide(v, q, s, c):
    """v [n] (n a multiple of WIDE_BLOCK) in nvfp4's wide layout (nvfp4_q8_dot_rows_wide):
    rounded as _quantize_q8, then per WIDE_BLOCK elements q = the codes of its even elements,
    then of its odd ones; per lane of the block's dot, s = the scale of the 32-block its elements
    lie in and c = -WIDE_BIAS times the sum of its codes (its quads': 4 bytes of q each)."""
    lin = np.empty(WIDE_BLOCK, np.int8)
    for b in range(v.shape[0] // WIDE_BLOCK):
        at, lanes = b * WIDE_BLOCK, b * WIDE_LANES
        d0, d1 = quantize_block(v, at, lin, 0), quantize_block(v, at + Q8_BLOCK, lin, Q8_BLOCK)
        wide_layout(lin, q, at, c, lanes)
        for lane in range(WIDE_LANES):
            s[lanes + lane] = d1 if WIDE_LANE_Q8[lane] else d0


@jit()
def wide_dot(fmt, cols):
    """Whether rows of `cols` columns of `fmt` take nvfp4's wide integer dot (its activation then
    laid out by _quantize_wide): nvfp4 on AVX2 hosts, whole blocks of WIDE_BLOCK."""
    return fmt == NVFP4 and AVX2 and cols % WIDE_BLOCK == 0


@jit()
def act_widths(fmt, cols):
    """(scales, lane starts) per activation row of `cols` quantised for the integer dot: a scale
    per lane of the wide layout and its lane starts where wide_dot, else a scale per 32."""
    if wide_dot(fmt, cols):
        return cols // WIDE_BLOCK * WIDE_LANES, cols // WIDE_BLOCK * WIDE_LANES
    return (cols + Q8_BLOCK - 1) // Q8_BLOCK, 0


@jit()
def quantized_act(fmt, rows, cols):
    """Arrays for `rows` activation rows of `cols` quantised for the integer dot: (codes, scales,
    the wide layout's lane starts: none unless wide_dot)."""
    scales, starts = act_widths(fmt, cols)
    return (np.empty((rows, cols), np.int8), np.empty((rows, scales), np.float32),
            np.empty((rows, starts), np.int32))  # fmt: skip


@jit()
def quantize_act(fmt, v, q, s, c):
    """The activation row v quantised for the integer dot into q, s (and c): _quantize_wide where
    wide_dot, else _quantize_q8."""
    if wide_dot(fmt, v.shape[0]):
        _quantize_wide(v, q, s, c)
    else:
        _quantize_q8(v, q, s)


@jit()
def integer_dot(fmt, n):
    """Whether an expert's n tokens take the integer dot: int8 weights at n <= INT_DOT_TOKENS,
    nvfp4's on AVX2 hosts at n <= NVFP4_INT_TOKENS (the wide dot where a row is whole blocks)."""
    if fmt == INT8:
        return n <= INT_DOT_TOKENS
    return fmt == NVFP4 and AVX2 and n <= NVFP4_INT_TOKENS


@jit(fastmath=True, inline="always")  # as bf16_dots
def int_dots(fmt, parts, proj, r, cols, inter, buf, vq, vs, vc, sel, t0, t1, dots):
    """dots[t - t0] = (row r of projection `proj`) . v[sel[t]] for t in [t0, t1), v quantised
    by quantize_act (vq, vs, vc): the row's codes dotted as integers, up to DOT_TOKENS tokens a pass
    over the row, times its scales (int8: the row's; nvfp4: its groups', decoded once into buf,
    and the tensor's); a last partial block of 32 by _int_tails."""
    full = cols // Q8_BLOCK
    if fmt == INT8:
        w = carray(address(parts[proj] + r * cols), (cols,), np.int8)
        for t in range(t0, t1, DOT_TOKENS):
            q8_dot_rows(w, vq, vs, sel, t, min(DOT_TOKENS, t1 - t), full, dots, t - t0)
        scale = _row_scale(parts, proj, r)
    else:
        codes, scales = _nvfp4_row(parts, proj, r, cols)
        groups = buf[: scales.shape[0]]
        _group_scales(scales, groups)
        wide = wide_dot(fmt, cols)
        for t in range(t0, t1, DOT_TOKENS):
            n = min(DOT_TOKENS, t1 - t)
            if wide:
                nvfp4_q8_dot_rows_wide(codes, vq, vs, vc, sel, t, n, cols // WIDE_BLOCK, groups,
                                       dots, t - t0)  # fmt: skip
            else:
                nvfp4_q8_dot_rows(codes, vq, vs, sel, t, n, full, groups, dots, t - t0)
        scale = _nvfp4_tensor_scale(parts, proj, r, inter) * np.float32(0.5)  # twice e2m1
    if full * Q8_BLOCK < cols:
        _int_tails(fmt, parts, proj, r, cols, buf, vq, vs, sel, t0, t1, dots)
    for t in range(t0, t1):
        dots[t - t0] *= scale


@jit(fastmath=True)
def _int_tails(fmt, parts, proj, r, cols, groups, vq, vs, sel, t0, t1, dots):
    """dots[t - t0] plus the columns past the last whole block of 32, in integers times their
    scales (nvfp4: twice the e2m1 values, one group of 16 left, groups decoded by int_dots)."""
    full = cols // Q8_BLOCK
    for t in range(t0, t1):
        row = sel[t]
        isum = 0
        if fmt == INT8:
            w = carray(address(parts[proj] + r * cols), (cols,), np.int8)
            for j in range(full * Q8_BLOCK, cols):
                isum += np.int32(w[j]) * np.int32(vq[row, j])
            dots[t - t0] += np.float32(isum) * vs[row, full]
        else:
            codes = carray(address(parts[proj] + r * (cols // 2)), (cols // 2,), np.uint8)
            for j in range(full * Q8_BLOCK // 2, cols // 2):
                lo, hi = E2M1_INT[codes[j] & 15], E2M1_INT[codes[j] >> 4]
                isum += lo * np.int32(vq[row, 2 * j]) + hi * np.int32(vq[row, 2 * j + 1])
            dots[t - t0] += np.float32(isum) * groups[2 * full] * vs[row, full]


# -- bf16: vdpbf16ps against activations rounded to bf16 ----------------------------------------


@jit()
def bf16_dotted(fmt):
    """Whether experts of `fmt` take the bf16 dot: on AVX512-BF16 hosts every format but
    float32, at any tokens (int8 experts of INT_DOT_TOKENS tokens, and nvfp4's, keep the integer
    dot: integer_dot is asked first). bf16 rows are read as they are; int8, e4m3 and e2m1 rows
    are first decoded to bf16 (exactly: their values have at most 6 significant bits), their
    scales applied to the dot. One vdpbf16ps per 32 weights and token outran the float path's
    decode and FMAs at every count measured: bf16, 1 to 64 tokens an expert; the quantised
    formats at T=4, k=8 (2-core Zen 4, two threads, two alternations): int8 5.3-5.8 -> 10.3-10.6
    GB/s, fp8_block 5.3-5.6 -> 11.0-11.7, nvfp4 1.1 -> 6.6-6.8; fp8_block at T=1 7.6-9.9 ->
    18.3-19.2."""
    return AVX512BF16 and fmt != F32


@jit(fastmath=True)
def _to_bf16(v, out):
    """out[j] = v[j] rounded to bf16 (to nearest, ties to even; torch's .to(bfloat16)), bits."""
    bits = v.view(np.uint32)
    for j in range(v.shape[0]):
        b = bits[j]
        out[j] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> 16)


@jit(fastmath=True)
def _decode_bf16_row(fmt, parts, proj, r, cols, inter, wb, groups):
    """wb[:cols] = row r of quantised projection `proj` as bf16 bits, exactly, up to a factor
    constant along the row, which it returns. fp8_block's block scales and nvfp4's group scales
    (into groups) are not applied: their dots apply them."""
    full = cols // BF16_BLOCK
    if fmt == INT8:
        codes = carray(address(parts[proj] + r * cols), (cols,), np.int8)
        decode_int8(codes, wb, full)
        for j in range(full * BF16_BLOCK, cols):
            _put(wb, j, np.float32(codes[j]))
        return _row_scale(parts, proj, r)
    if fmt == FP8:
        codes = carray(address(parts[proj] + r * cols), (cols,), np.uint8)
        decode_e4m3(codes, wb, full)
        for j in range(full * BF16_BLOCK, cols):
            _put(wb, j, e4m3_value(codes[j]))
        return np.float32(1.0)
    # NVFP4: the codes' values alone (bf16_dot_rows_per_16 applies the group scales)
    codes, scales = _nvfp4_row(parts, proj, r, cols)
    _group_scales(scales, groups)
    decode_e2m1_bf16(codes, wb, full)
    for j in range(full * BF16_BLOCK, cols):
        _put(wb, j, E2M1[codes[j // 2] >> (4 * (j % 2)) & 15])
    return _nvfp4_tensor_scale(parts, proj, r, inter)


@jit()
def _fp8_scales(parts, proj, r, cols, inter):
    """The block scales of row r of fp8_block projection `proj`: one per 128 columns."""
    blocks = (cols + FP8_BLOCK - 1) // FP8_BLOCK
    if proj == W13:  # gate and up are blocked apart
        iblocks = (inter + FP8_BLOCK - 1) // FP8_BLOCK
        srow = (r // inter) * iblocks + (r % inter) // FP8_BLOCK
    else:
        srow = r // FP8_BLOCK
    return carray(address(parts[proj + 2] + 4 * srow * blocks), (blocks,), np.float32)


@jit(fastmath=True)
def _bf16_tail(w, v, j0, cols):
    acc = np.float32(0.0)
    for j in range(j0, cols):
        acc += f32_of_bits(np.uint32(w[j]) << 16) * f32_of_bits(np.uint32(v[j]) << 16)
    return acc


# inline: a call of a numba function with this many array arguments costs ~40-70 ns a row, as
# much as a row's dot from cache (int8, one token: 114 -> 42 ns a row of 2048)
@jit(fastmath=True, inline="always")
def bf16_dots(fmt, parts, proj, r, cols, inter, wb, groups, vb, sel, t0, t1, dots):
    """dots[t - t0] = (row r of projection `proj`) . vb[sel[t]] for t in [t0, t1), vb
    activations rounded by _to_bf16: a bf16 row as it is, another decoded into wb first; whole
    blocks of 32 by bf16_dot_rows (up to DOT_TOKENS tokens a pass over the row; fp8_block's
    scaled per 128 columns, nvfp4's per 16), the rest by _bf16_tails. No allocated array is
    bound to a new name here: each binding costs two atomic reference counts (numba's)."""
    full = cols // BF16_BLOCK
    if fmt == BF16:
        w = carray(address(parts[proj] + 2 * r * cols), (cols,), np.uint16)  # no refcount
        for t in range(t0, t1, DOT_TOKENS):
            bf16_dot_rows(w, vb, sel, t, min(DOT_TOKENS, t1 - t), full, groups, dots, t - t0)
        if full * BF16_BLOCK < cols:
            _bf16_tails(fmt, w, groups, vb, sel, t0, t1, cols, dots)
        return
    if fmt == FP8 and FUSED_E4M3 and cols % FP8_BLOCK == 0:
        codes = carray(address(parts[proj] + r * cols), (cols,), np.uint8)
        scales = _fp8_scales(parts, proj, r, cols, inter)  # no refcount
        for t in range(t0, t1, DOT_TOKENS):
            n = min(DOT_TOKENS, t1 - t)
            e4m3_dot_rows(codes, vb, sel, t, n, cols // FP8_BLOCK, scales, dots, t - t0)
        return
    scale = _decode_bf16_row(fmt, parts, proj, r, cols, inter, wb, groups)
    if fmt == FP8:
        scales = _fp8_scales(parts, proj, r, cols, inter)  # no refcount
        for t in range(t0, t1, DOT_TOKENS):
            n = min(DOT_TOKENS, t1 - t)
            bf16_dot_rows_per_128(wb, vb, sel, t, n, full, scales, dots, t - t0)
        if full * BF16_BLOCK < cols:
            _bf16_tails(fmt, wb, scales, vb, sel, t0, t1, cols, dots)
        return
    for t in range(t0, t1, DOT_TOKENS):
        n = min(DOT_TOKENS, t1 - t)
        if fmt == NVFP4:
            bf16_dot_rows_per_16(wb, vb, sel, t, n, full, groups, dots, t - t0)
        else:
            bf16_dot_rows(wb, vb, sel, t, n, full, groups, dots, t - t0)
    if full * BF16_BLOCK < cols:
        _bf16_tails(fmt, wb, groups, vb, sel, t0, t1, cols, dots)
    for t in range(t0, t1):
        dots[t - t0] *= scale


@jit(fastmath=True)
def _bf16_tails(fmt, w, scales, vb, sel, t0, t1, cols, dots):
    """dots[t - t0] plus the columns past the last whole block of 32 (they lie in one scale's
    block: fp8_block's 128, nvfp4's 16). Its own function, called only where there are such
    columns: a call with this many arrays costs ~20 ns a row where none are."""
    j0 = cols // BF16_BLOCK * BF16_BLOCK
    for t in range(t0, t1):
        tail = _bf16_tail(w, vb[sel[t]], j0, cols)
        if fmt == FP8:
            tail *= scales[j0 // FP8_BLOCK]
        elif fmt == NVFP4:
            tail *= scales[j0 // NVFP4_GROUP]
        dots[t - t0] += tail


# -- float32 activations: the rest ----------------------------------------------------------

# bf16 and fp8_block rows on AVX2 hosts without the bf16 dot are decoded in registers and dotted
# with every token in one pass (bf16_f32_dot_rows, e4m3_f32_dot_rows; e4m3 by F16C's vcvtph2ps),
# where they were decoded into L1, then dotted once per token. One AVX2-only EPYC core, rows of
# 2048 from L2: bf16 T=1 287-349 -> 165 ns, T=4 637-828 -> 282-327; fp8_block T=1 734-766 -> 251,
# T=4 1084-1233 -> 370. Pool, two threads, k=8, alternated twice: bf16 T=1 17.1-17.5 ->
# 19.8-20.5 GB/s, T=4 9.8 -> 15.4; fp8_block T=1 5.3-5.6 -> 12.8-12.9, T=4 3.6-3.7 -> 7.3-8.1.
FUSED_F32 = AVX2 and F16C


@jit()
def f32_fused(fmt, cols):
    """Whether rows of `cols` columns of `fmt` take the fused float32 dot: bf16 of whole steps,
    fp8_block of whole 128-blocks, on AVX2 hosts."""
    if not FUSED_F32:
        return False
    return (fmt == BF16 and cols % F32_STEP == 0) or (fmt == FP8 and cols % FP8_BLOCK == 0)


@jit(fastmath=True, inline="always")  # as bf16_dots
def float_dots(fmt, parts, proj, r, cols, inter, buf, groups, v, sel, t0, t1, dots):
    """dots[t - t0] = (row r of projection `proj`) . v[sel[t]] for t in [t0, t1), v float32: by
    the fused dot where f32_fused (up to DOT_TOKENS tokens a pass over the row), else the row
    decoded into buf and dotted with each token."""
    if f32_fused(fmt, cols):
        steps = cols // F32_STEP
        if fmt == BF16:
            w = carray(address(parts[proj] + 2 * r * cols), (cols,), np.uint16)
            for t in range(t0, t1, DOT_TOKENS):
                bf16_f32_dot_rows(w, v, sel, t, min(DOT_TOKENS, t1 - t), steps, groups, dots,
                                  t - t0)  # fmt: skip
            return
        codes = carray(address(parts[proj] + r * cols), (cols,), np.uint8)
        scales = _fp8_scales(parts, proj, r, cols, inter)
        for t in range(t0, t1, DOT_TOKENS):
            e4m3_f32_dot_rows(codes, v, sel, t, min(DOT_TOKENS, t1 - t), steps, scales, dots,
                              t - t0)  # fmt: skip
        return
    scale = decode_row(fmt, parts, proj, r, cols, inter, buf, groups)
    for t in range(t0, t1):
        dots[t - t0] = _dot(buf, v[sel[t]], cols) * scale


@jit(fastmath=True)
def _silu(a):
    return a / (np.float32(1.0) + np.exp(-a))


# -- one call ----------------------------------------------------------------------------------


@jit()
def _expert_parts(plan, e, parts):
    """parts[:] = the addresses of expert e's parts in the plan."""
    for p in range(PARTS):
        parts[p] = plan[HEADER + e * PARTS + p]


# Runs of this many rows or fewer are short (_asks_next_run).
SHORT_RUN = 32


@jit(inline="always")
def _asks_next_run(fmt, rows2):
    """Whether phase 2 asks for the next expert's rows as it dots this one's (run_call): for
    the quantised formats always, for bf16 and float32 (read at the memory's rate once
    streaming) only on short runs. 2-core Zen 5, one worker + the caller, k=8, alternated two
    to four times, phase 2 us: with the 15-thread boxes' runs of 16 rows (units cut as for 8x the
    threads) int8 T=4 1015-1094 -> 544-562, fp8_block T=4 838 -> 491-542, bf16 T=4 774-1018 ->
    598-672, nvfp4 T=1 406-457 -> 352-357; on its own runs of 128 rows int8 T=4 481-550 ->
    414-442, fp8_block T=4 508-570 -> 400-417, nvfp4 T=1 344-409 -> 269-312, but bf16 T=1
    650-670 -> 738-771. Asking for the next unit's rows in phase 1 slowed phase 1 by 10-35%;
    asking for rows 1-8 ahead within a run won nothing (the prefetchers stream a run)."""
    return (fmt != BF16 and fmt != F32) or rows2 <= SHORT_RUN


@jit(inline="always")
def _prefetch_row(fmt, plan, e, proj, r, cols):
    """Ask for row r of expert e's projection `proj` (and nvfp4's group scales of it) in the
    cache, a prefetcht0 per line."""
    base = HEADER + e * PARTS
    if fmt == BF16:
        size = 2 * cols
    elif fmt == F32:
        size = 4 * cols
    elif fmt == NVFP4:
        size = cols // 2
        prefetch(plan[base + proj + 2] + r * (cols // NVFP4_GROUP))
    else:  # int8, fp8_block: a byte a weight (their scales: one line serves many rows)
        size = cols
    at = plan[base + proj] + r * size
    for off in range(0, size, 64):
        prefetch(at + off)


@jit(inline="always")
def _stamp(plan, worker, point):
    """Where the plan asks for stamps: this worker's time-stamp counter at `point` (the
    caller, worker == plan[WORKERS], has no row of stamps)."""
    if plan[STAMPS] != 0 and worker < plan[WORKERS]:
        carray(address(plan[STAMPS] + 8 * (worker * STAMP_COUNT + point)), (1,), np.int64)[0] = (
            cycles()
        )


# -- a worker's scratch -------------------------------------------------------------------------
# One block per worker for the pool's life (serve), grown when a call needs more; each call carves
# its buffers from it (_buffers) as arrays without a reference count (carray). An allocated
# array passed through the per-row functions inlined into the call's loops cost two atomic
# counts per array and row wherever numba could not prune them (a branch with a loop or a call
# in the row's function). One AVX2 EPYC core, rows of 2048 from L2: int8 149 -> 73 ns, nvfp4
# 231 -> 154; pool, two threads, k=8: int8 T=1 14.9-15.1 -> 18.1-18.5 GB/s, nvfp4 7.4 -> 10.1.
SCRATCH_ALIGN = 64  # a cache line


@jit(inline="always")
def _carve(at, shape, dtype):
    """(an array of `shape` and `dtype` without a reference count, at the first address from
    `at` aligned to SCRATCH_ALIGN; the address after it)."""
    start = (at + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    a = carray(address(start), shape, dtype)
    return a, start + a.size * a.itemsize


@jit()
def _buffers(plan, base):
    """The call's buffers, carved from the scratch at address `base`, and the address after
    them (with base 0: the bytes the call needs, less alignment)."""
    fmt, tokens = plan[FMT], plan[TOKENS]
    hidden, inter = plan[HIDDEN], plan[INTER]
    pairs = max(carray(address(plan[TOKEN_START]), (plan[EXPERTS] + 1,), np.int64)[-1], 1)
    width = max(hidden, inter)
    # int8 experts of at most INT_DOT_TOKENS tokens, and nvfp4's on AVX2 (integer_dot): x and
    # act rows quantised per block; each worker quantises its own copy of the rows they read (a
    # few KiB per token, against MiBs of weights per call: no barrier to share them). bf16 dot
    # experts (bf16_dotted): x and act rounded to bf16, likewise per worker.
    qx, qa = (tokens, pairs) if integer_dot(fmt, 1) else (0, 0)
    bx, ba = (tokens, pairs) if bf16_dotted(fmt) else (0, 0)
    xs_width, xc_width = act_widths(fmt, hidden)
    as_width, ac_width = act_widths(fmt, inter)
    buf, end = _carve(base, (width,), np.float32)
    wb, end = _carve(end, (width,), np.uint16)  # a quantised row decoded to bf16 bits
    groups, end = _carve(end, (width // NVFP4_GROUP + 1,), np.float32)  # nvfp4's group scales
    parts, end = _carve(end, (PARTS,), np.int64)
    dots, end = _carve(end, (pairs,), np.float32)  # a row's dots with an expert's tokens
    same, end = _carve(end, (pairs,), np.int64)  # phase 2's vector of pair t is act row t
    xq, end = _carve(end, (qx, hidden), np.int8)
    xs, end = _carve(end, (qx, xs_width), np.float32)
    xc, end = _carve(end, (qx, xc_width), np.int32)
    aq, end = _carve(end, (qa, inter), np.int8)
    as_, end = _carve(end, (qa, as_width), np.float32)
    ac, end = _carve(end, (qa, ac_width), np.int32)
    ready, end = _carve(end, (2, tokens), np.bool_)  # each token's x quantised, rounded once
    xb, end = _carve(end, (bx, hidden), np.uint16)
    ab, end = _carve(end, (ba, inter), np.uint16)
    return buf, wb, groups, parts, dots, same, xq, xs, xc, aq, as_, ac, ready, xb, ab, end


@jit(inline="always")
def unowned(a):
    """A view of the array `a` without its reference count, as the call's buffers are (for code
    that runs the per-row functions outside a call: scripts/bench_cpu_rows.py). `a` must
    outlive it."""
    return carray(address(a.ctypes.data), a.shape, a.dtype)


@jit()
def scratch_bytes(plan):
    """The scratch a worker needs for call `plan`."""
    return _buffers(plan, 0)[-1] + SCRATCH_ALIGN


@jit(fastmath=True)
def _prepare_x(fmt, k, starts, rows, x, xq, xs, xc, xb, ready):
    """x as each expert's dot reads it: quantised (integer_dot) or rounded to bf16 (bf16_dotted),
    only for the tokens of experts that take that dot (int8's few tokens never read bf16)."""
    ready[:] = False  # [0, token]: quantised, [1, token]: rounded
    for e in range(k):
        integer = integer_dot(fmt, starts[e + 1] - starts[e])
        if integer or bf16_dotted(fmt):
            for t in range(starts[e], starts[e + 1]):
                row, form = rows[t], 0 if integer else 1
                if not ready[form, row]:
                    if integer:
                        quantize_act(fmt, x[row], xq[row], xs[row], xc[row])
                    else:
                        _to_bf16(x[row], xb[row])
                    ready[form, row] = True


@jit(fastmath=True)
def _prepare_act(fmt, k, starts, act, aq, as_, ac, ab):
    """Phase 2's input, act, as each expert's dot reads it (as _prepare_x)."""
    for e in range(k):
        if integer_dot(fmt, starts[e + 1] - starts[e]):
            for t in range(starts[e], starts[e + 1]):
                quantize_act(fmt, act[t], aq[t], as_[t], ac[t])
        elif bf16_dotted(fmt):
            for t in range(starts[e], starts[e + 1]):
                _to_bf16(act[t], ab[t])


@jit(fastmath=True)
def run_call(plan, worker, ctrl, gen, scratch, spin):
    """A share of the call `plan`: phase 1, the barrier, phase 2; its buffers in the scratch at
    address `scratch` (scratch_bytes(plan) of it); `spin`: cycles it spins at the barrier before
    it sleeps. worker < plan[WORKERS]: a pool worker, which claims its own units first; worker ==
    plan[WORKERS]: the caller, which claims only what the workers have not (help_and_wait),
    prepares a phase's inputs only where a unit of it is left (arriving late, it may find none;
    prepared before it claims, so that no unit it holds waits on them) and stamps nothing. The
    barrier counts phase 1's units done, not threads: the caller's are in it, and it holds the
    workers there only for a unit it has claimed. -> the units this thread ran."""
    _stamp(plan, worker, STARTED)
    fmt, k, tokens = plan[FMT], plan[EXPERTS], plan[TOKENS]
    hidden, inter, workers = plan[HIDDEN], plan[INTER], plan[WORKERS]
    starts = carray(address(plan[TOKEN_START]), (k + 1,), np.int64)
    pairs = starts[k]
    rows = carray(address(plan[TOKEN_ROW]), (max(pairs, 1),), np.int64)
    weights = carray(address(plan[TOKEN_WEIGHT]), (max(pairs, 1),), np.float32)
    x = carray(address(plan[X]), (tokens, hidden), np.float32)
    act = carray(address(plan[ACT]), (max(pairs, 1), inter), np.float32)
    out = carray(address(plan[OUT]), (tokens, hidden), np.float32)
    buf, wb, groups, parts, dots, same, xq, xs, xc, aq, as_, ac, ready, xb, ab, _ = _buffers(
        plan, scratch
    )
    for t in range(same.shape[0]):
        same[t] = t
    rows1, blocks1, rows2, units2 = phase_units(plan)
    units1 = k * blocks1
    caller = worker == workers
    if not caller or _units_left(ctrl, 1, units1, workers):
        _prepare_x(fmt, k, starts, rows, x, xq, xs, xc, xb, ready)
    _stamp(plan, worker, PREPARED)
    ran = 0
    victim = 0
    while True:  # phase 1: units of rows [i0, i1) of I of expert e
        unit, victim = _claim(ctrl, 1, units1, worker, workers, victim)
        if unit < 0:
            break
        ran += 1
        e = unit // blocks1
        i0 = unit % blocks1 * rows1
        i1 = min(inter, i0 + rows1)
        _expert_parts(plan, e, parts)
        t0, t1 = starts[e], starts[e + 1]
        if integer_dot(fmt, t1 - t0):
            for i in range(i0, i1):
                int_dots(fmt, parts, W13, i, hidden, inter, buf, xq, xs, xc, rows, t0, t1, dots)
                for t in range(t0, t1):
                    act[t, i] = dots[t - t0]  # gate
                int_dots(fmt, parts, W13, inter + i, hidden, inter, buf, xq, xs, xc, rows, t0,
                         t1, dots)  # fmt: skip
                for t in range(t0, t1):
                    act[t, i] = _silu(act[t, i]) * dots[t - t0] * weights[t]
        elif bf16_dotted(fmt):
            for i in range(i0, i1):
                bf16_dots(fmt, parts, W13, i, hidden, inter, wb, groups, xb, rows, t0, t1, dots)
                for t in range(t0, t1):
                    act[t, i] = dots[t - t0]  # gate
                bf16_dots(fmt, parts, W13, inter + i, hidden, inter, wb, groups, xb, rows, t0,
                          t1, dots)  # fmt: skip
                for t in range(t0, t1):
                    act[t, i] = _silu(act[t, i]) * dots[t - t0] * weights[t]
        else:
            for i in range(i0, i1):
                float_dots(fmt, parts, W13, i, hidden, inter, buf, groups, x, rows, t0, t1, dots)
                for t in range(t0, t1):
                    act[t, i] = dots[t - t0]  # gate
                float_dots(fmt, parts, W13, inter + i, hidden, inter, buf, groups, x, rows, t0,
                           t1, dots)  # fmt: skip
                for t in range(t0, t1):
                    act[t, i] = _silu(act[t, i]) * dots[t - t0] * weights[t]
        if atomic_add(ctrl, BARRIER, 1) + 1 == units1:  # the unit's act written before the count
            wake(ctrl, BARRIER, BARRIER_SLEEPERS)

    # every unit's act is needed below: wait for all of this call's phase 1
    _stamp(plan, worker, ARRIVED)
    now = atomic_load(ctrl, BARRIER)
    while now < units1:
        now = wait_change(ctrl, BARRIER, now, BARRIER_SLEEPERS, spin)
    _stamp(plan, worker, PASSED)

    if not caller or _units_left(ctrl, 2, units2, workers):
        _prepare_act(fmt, k, starts, act, aq, as_, ac, ab)
    victim = 0
    # Phase 2 walks a unit's rows expert by expert: a run of rows2 rows of one expert's W2 (16
    # on the 15-thread boxes, 128 with one worker), then the next expert's, elsewhere in memory,
    # where the hardware's prefetchers start over. So each row asks for the same row of the next
    # expert (one run ahead), except for bf16 and float32 on long runs (_asks_next_run).
    ask_next = _asks_next_run(fmt, rows2)
    while True:  # phase 2: units of rows [d0, d1) of D, every expert's
        unit, victim = _claim(ctrl, 2, units2, worker, workers, victim)
        if unit < 0:
            break
        ran += 1
        d0 = unit * rows2
        d1 = min(hidden, d0 + rows2)
        for t in range(tokens):
            for d in range(d0, d1):
                out[t, d] = 0.0
        for e in range(k):
            _expert_parts(plan, e, parts)
            t0, t1 = starts[e], starts[e + 1]
            if integer_dot(fmt, t1 - t0):
                for d in range(d0, d1):
                    if ask_next and e + 1 < k:
                        _prefetch_row(fmt, plan, e + 1, W2, d, inter)
                    int_dots(fmt, parts, W2, d, inter, inter, buf, aq, as_, ac, same, t0, t1, dots)
                    for t in range(t0, t1):
                        out[rows[t], d] += dots[t - t0]
            elif bf16_dotted(fmt):
                for d in range(d0, d1):
                    if ask_next and e + 1 < k:
                        _prefetch_row(fmt, plan, e + 1, W2, d, inter)
                    bf16_dots(fmt, parts, W2, d, inter, inter, wb, groups, ab, same, t0, t1, dots)
                    for t in range(t0, t1):
                        out[rows[t], d] += dots[t - t0]
            else:
                for d in range(d0, d1):
                    if ask_next and e + 1 < k:
                        _prefetch_row(fmt, plan, e + 1, W2, d, inter)
                    float_dots(fmt, parts, W2, d, inter, inter, buf, groups, act, same, t0, t1,
                               dots)  # fmt: skip
                    for t in range(t0, t1):
                        out[rows[t], d] += dots[t - t0]
    _stamp(plan, worker, FINISHED)
    return ran


@jit(inline="always")
def _published_plan(ctrl):
    """The plan of the call last published in ctrl, all its words."""
    at = atomic_load(ctrl, PLAN)
    words = HEADER + carray(address(at), (HEADER,), np.int64)[EXPERTS] * PARTS
    return carray(address(at), (words,), np.int64)


@jit(inline="always")
def _scratch_for(plan, scratch):
    """`scratch`, or a larger one where call `plan` needs more (scratch_bytes)."""
    need = scratch_bytes(plan)
    return np.empty(need, np.uint8) if need > scratch.shape[0] else scratch


@jit()
def serve(ctrl, worker, spin):
    """A worker's whole life: wait for a call (spinning `spin` time-stamp cycles before it
    sleeps), run its share, count it done; until STOP."""
    seen = 0  # calls are numbered from 1, and the next is published only after all finish one
    scratch = np.empty(0, np.uint8)  # this worker's buffers, grown to the largest call's
    while True:
        gen = wait_change(ctrl, GEN, seen, WORKER_SLEEPERS, spin)
        seen = gen
        if atomic_load(ctrl, STOP):
            return
        plan = _published_plan(ctrl)
        scratch = _scratch_for(plan, scratch)
        run_call(plan, worker, ctrl, gen, scratch.ctypes.data, spin)
        if atomic_add(ctrl, DONE, 1) + 1 == gen * plan[WORKERS]:
            wake(ctrl, DONE, CALLER_SLEEPERS)


@jit()
def wait_done(ctrl, gen, workers, spin):
    """The caller's wait for call `gen` (GIL released: the engine's other threads run), `spin`
    time-stamp cycles spun before each sleep; returns the time-stamp counter when it saw the
    call done."""
    now = atomic_load(ctrl, DONE)
    while now < gen * workers:
        now = wait_change(ctrl, DONE, now, CALLER_SLEEPERS, spin)
    return cycles()


@jit()
def help_and_wait(ctrl, gen, workers, scratch, spin, worker_cores):
    """wait_done, the caller helping first: the units of call `gen` no worker has claimed yet,
    run on the caller's core (which only spun before; llama.cpp's main thread is likewise
    thread 0 of its pool), buffers in `scratch`, grown to the call's need. Not where the
    scheduler has put the caller on a core a worker is pinned to (worker_cores[cpu] != 0): that
    worker, woken there, would find its units taken and spin at the barrier on the core the
    caller computes on (the 15-worker H100 box, the caller unpinned: one worker ran no unit of
    phase 1 in every call, bf16 9-27% slower than the caller only waiting). -> (wait_done's
    time-stamp counter, the units the caller ran (-1: it was on a worker's core), the
    scratch)."""
    cpu = current_cpu()
    if 0 <= cpu < worker_cores.shape[0] and worker_cores[cpu] != 0:
        return wait_done(ctrl, gen, workers, spin), -1, scratch
    ran = 0
    if atomic_load(ctrl, DONE) < gen * workers:  # else an older call, or nothing left
        plan = _published_plan(ctrl)  # call gen's: the caller published it, and no later one yet
        scratch = _scratch_for(plan, scratch)
        ran = run_call(plan, workers, ctrl, gen, scratch.ctypes.data, spin)
    return wait_done(ctrl, gen, workers, spin), ran, scratch


@jit()
def start_call(ctrl, plan_addr, gen):
    """Publish call `gen` (its plan at plan_addr) to the waiting workers, their claim counters
    zeroed (each worker of the last call counted itself done after its last claim); returns
    the time-stamp counter just before."""
    workers = carray(address(plan_addr), (HEADER,), np.int64)[WORKERS]
    for w in range(workers):
        ctrl[_counter(1, w, workers)] = ctrl[_counter(2, w, workers)] = 0
    ctrl[BARRIER] = 0  # phase 1's units done (every thread of the last call is past it)
    ctrl[PLAN] = plan_addr
    published = cycles()
    publish(ctrl, GEN, gen, WORKER_SLEEPERS)
    return published


@jit()
def stop(ctrl, gen):
    ctrl[STOP] = 1
    publish(ctrl, GEN, gen, WORKER_SLEEPERS)


# route's refusals (its status below 0)
OUTSIDE_BANK, REPEATED, NOT_ROUTED = -1, -2, -3
# A bank's words (ft.engine.cpu.layer.BankLayout.words): its format, experts, D and I, then
# expert 0's part addresses and the bytes from one expert's parts to the next's
BANK_CODE, BANK_EXPERTS, BANK_HIDDEN, BANK_INTER, BANK_BASE = range(5)
BANK_STRIDE = BANK_BASE + PARTS
BANK_WORDS = BANK_STRIDE + PARTS


@jit()
def start_routed(ctrl, gen, stamps, bank, ids_at, weights_at, tokens, topk, chosen, workers,
                 x_at, x_bf16, out_at):  # fmt: skip
    """A routed layer call built (route) and published (start_call) in one compiled call: each
    call into numba, and each line of Python, costs ~5 us on the caller right after a layer
    call has streamed the caches. bank: its words (BANK_WORDS); stamps: the STAMPS word. The
    routing (ids int64, weights float32 [tokens, topk]) and x [tokens, D] (bf16 bits where
    x_bf16, else float32; D the bank's) by address, contiguous, as the caller checked them: a
    tensor's address costs 0.1 us, making it a numpy array 1.5-3 us (a submit made three).
    -> (status: route's; the call, as route's; the time-stamp counter at the publish, 0 if
    refused)."""
    ids = carray(address(ids_at), (tokens, topk), np.int64)
    weights = carray(address(weights_at), (tokens, topk), np.float32)
    base, stride = bank[BANK_BASE:BANK_STRIDE], bank[BANK_STRIDE:BANK_WORDS]
    shape = (tokens, bank[BANK_HIDDEN])
    if x_bf16:
        x16 = carray(address(x_at), shape, np.int16)
        status, call = route(ids, weights, chosen, bank[BANK_EXPERTS], base, stride,
                             bank[BANK_CODE], bank[BANK_INTER], workers, x16, out_at)  # fmt: skip
    else:
        x32 = carray(address(x_at), shape, np.float32)
        status, call = route(ids, weights, chosen, bank[BANK_EXPERTS], base, stride,
                             bank[BANK_CODE], bank[BANK_INTER], workers, x32, out_at)  # fmt: skip
    if status < 0:
        return status, call, 0
    call[STAMPS] = stamps
    return status, call, start_call(ctrl, call.ctypes.data, gen)


@jit()
def route(ids, weights, chosen, bank_experts, base, stride, code, inter, workers, x, out_addr):
    """-> (status, call): a layer call from its routing (ids, weights [T, K]), built in one
    compiled pass: of `chosen` (experts of a bank of `bank_experts`, in that order) each the
    routing sends a token to, its parts at base + e * stride, with its tokens in order. `call`
    holds the plan at its start, then what the plan points at (the experts' token starts, each
    (expert, token) pair's row and router weight, x as float32 and act); out (out_addr) is the
    caller's. status: k, the experts in the plan, or OUTSIDE_BANK, REPEATED (an expert given
    twice) or NOT_ROUTED (no token reaches them), with an empty call. x [T, D] is float32 or
    bf16 bits (int16). In Python (~20 array operations) the plan took 35 us, and 120-400 us
    right after a call had streamed the caches (8 experts, 2-core Zen 4): on the critical path
    of every layer call."""
    tokens, hidden = x.shape
    k = pairs = 0
    for c in range(chosen.shape[0]):
        e = chosen[c]
        if e < 0 or e >= bank_experts:
            return OUTSIDE_BANK, np.empty(0, np.int64)
        for c2 in range(c):
            if chosen[c2] == e:
                return REPEATED, np.empty(0, np.int64)
        n = 0
        for t in range(tokens):
            for j in range(ids.shape[1]):
                if ids[t, j] == e:
                    n += 1
        if n > 0:
            k += 1
        pairs += n
    if k == 0:
        return NOT_ROUTED, np.empty(0, np.int64)
    # the call's words: plan, starts, rows, then float32 pairs: weights, x, act
    at_starts = HEADER + k * PARTS
    at_rows = at_starts + k + 1
    at_floats = at_rows + pairs
    floats = pairs + tokens * hidden + pairs * inter
    call = np.zeros(at_floats + (floats + 1) // 2, np.int64)
    f = call[at_floats:].view(np.float32)
    wts, xs = f[:pairs], f[pairs : pairs + tokens * hidden]
    _copy_x(x, xs)
    starts, rows = call[at_starts:at_rows], call[at_rows:at_floats]
    e_at = pair = 0
    for c in range(chosen.shape[0]):
        e, first = chosen[c], pair
        for t in range(tokens):
            for j in range(ids.shape[1]):
                if ids[t, j] == e:
                    rows[pair], wts[pair] = t, weights[t, j]
                    pair += 1
        if pair > first:  # an expert no token reaches is no work
            for p in range(PARTS):
                call[HEADER + e_at * PARTS + p] = base[p] + e * stride[p]
            e_at += 1
            starts[e_at] = pair
    here = call.ctypes.data
    call[FMT], call[EXPERTS], call[TOKENS], call[HIDDEN] = code, k, tokens, hidden
    call[INTER], call[WORKERS], call[OUT] = inter, workers, out_addr
    call[X] = here + 8 * at_floats + 4 * pairs
    call[ACT] = here + 8 * at_floats + 4 * (pairs + tokens * hidden)
    call[TOKEN_START], call[TOKEN_ROW] = here + 8 * at_starts, here + 8 * at_rows
    call[TOKEN_WEIGHT] = here + 8 * at_floats
    return k, call


def _copy_x(x, xs):
    """xs (flat float32) = x [T, D], float32 or bf16 bits (int16)."""


@overload(_copy_x)
def _copy_x_typed(x, xs):
    if x.dtype == types.int16:
        return lambda x, xs: _copy_bf16(x, xs)
    return lambda x, xs: _copy_f32(x, xs)


@jit()
def _copy_bf16(x, xs):
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            xs[t * x.shape[1] + j] = f32_of_bits(np.uint32(np.uint16(x[t, j])) << 16)


@jit()
def _copy_f32(x, xs):
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            xs[t * x.shape[1] + j] = x[t, j]


def compile_all() -> None:
    """Compile (or load from numba's disk cache) what the pool runs, before its workers start:
    no worker or decode step pays for it."""
    ctrl, word = types.int64[::1], types.int64
    serve.compile((ctrl, word, word))
    wait_done.compile((ctrl, word, word, word))
    help_and_wait.compile((ctrl, word, word, types.uint8[::1], word, types.uint8[::1]))
    start_call.compile((ctrl, word, word))
    stop.compile((ctrl, word))
    start_routed.compile((ctrl, word, word, ctrl, word, word, word, word, ctrl, word, word,
                          types.boolean, word))  # fmt: skip
