"""The pool's layer kernel (ft.engine.cpu): every format it reads against a float32 torch
reference of the dequantised weights, at one and several workers; calls in a row; off-pool
work counted and warned once."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ft.bench.cpu_moe import ACT_FLIPS
from ft.engine.cpu import intrinsics, layer_kernel
from ft.engine.cpu import phases as phases_module
from ft.engine.cpu.layer import act_rounding, bf16_round, int_dot_tokens, kernel_format, q8_0
from ft.engine.cpu.pool import THREAD_PREFIX, CpuMoeExecutor, ExpertJob, expert_jobs
from ft.engine.cpu.sync import control_block
from tests.engine import quant_ref

EXPERTS = 5
# (D, I): rows of I and of D split unevenly over 3 workers; 320 x 208 crosses fp8's 128-blocks
# in both dims and ends mid-block; 64 x 48 is smaller than one block; 256 x 384 is whole
# 128-blocks in both (fp8_block's rows decoded in registers, e4m3_dot_rows)
SHAPES = [(64, 48), (320, 208), (256, 384)]
# (format, weight dtype): what the layer kernel reads
KERNEL_CASES = [("bf16", torch.bfloat16), ("bf16", torch.float32), ("int8", None),
                ("fp8_block", None), ("nvfp4", None)]  # fmt: skip


def bank_for(fmt: str, dtype, hidden: int, inter: int, seed: int):
    """(bank in the format, the float32 weights it stands for)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(EXPERTS, hidden, inter, generator=gen) / inter**0.5
    if fmt == "bf16":
        bank = {"w13": w13.to(dtype), "w2": w2.to(dtype)}
        return bank, (bank["w13"].float(), bank["w2"].float())
    bank = {k: v.contiguous() for k, v in quant_ref.quantize(w13, w2, fmt).items()}
    return bank, quant_ref.dequantize(bank, fmt)


reference = quant_ref.moe_reference  # float32, every token through its experts one at a time


def routing(tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)  # [T, K]
    return ids, weights


def _assert_kernel_result(out, fmt, bank, x, w13, w2, ids, weights):
    """out is the float32 reference's, with the layer kernel's rounding of x and act modelled
    (the integer dot's, the bf16 dot's) and ACT_FLIPS act roundings allowed the other way."""
    int_dot = int_dot_tokens(fmt, bank["w13"].dtype)
    bf16_dot = act_rounding(fmt, bank["w13"].dtype, 64) is bf16_round
    want = reference(x, w13, w2, ids, weights, int_dot, bf16_dot)
    flip = quant_ref.act_flip(x, w13, w2, ids, weights) if int_dot or bf16_dot else 0.0
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 + ACT_FLIPS * flip)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt,dtype", KERNEL_CASES)
def test_layer_kernel_equals_float32_reference(fmt, dtype, shape, threads):
    hidden, inter = shape
    bank, (w13, w2) = bank_for(fmt, dtype, hidden, inter, seed=hidden + threads)
    assert kernel_format(fmt, bank["w13"].dtype) is not None  # the layer kernel, not a fallback
    with CpuMoeExecutor(threads=threads) as pool:
        # decode: one token; four sharing experts; seven through every expert; eight over two
        # experts each (int8, nvfp4: some experts within the integer dot's tokens, some past,
        # a token in both)
        for tokens, top_k in ((1, 2), (4, 3), (7, EXPERTS), (8, 2)):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=gen)
            ids, weights = routing(tokens, top_k, seed=tokens + threads)
            jobs = expert_jobs(bank, ids, weights, list(range(EXPERTS)), fmt)
            out = pool.submit(x, jobs).wait()
            # int8, nvfp4 (AVX2): experts of one token take the integer dot; on AVX512-BF16
            # every other expert but float32's the bf16 dot; their rounding modelled; a few act
            # roundings may land the other way (ACT_FLIPS, one step each)
            _assert_kernel_result(out, fmt, bank, x, w13, w2, ids, weights)
        assert pool.stats.experts_inline == 0


def test_bf16_activations_round_as_torch_does():
    """The bf16 dot's activations (_to_bf16) are torch's bf16 bit for bit, ties to even
    included: the references model them with torch, and the pool tests' tolerance for act
    roundings (ACT_FLIPS) is too wide to see truncation instead."""
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-30, 30, (4096,), generator=gen)
    bits = v.view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000  # halfway between two bf16, both parities of the bf16
    v = torch.cat([v, ties.view(torch.float32), torch.tensor([0.0, -0.0, 3.0e38, -1e-40])])
    got = torch.empty(v.shape, dtype=torch.int16)
    layer_kernel._to_bf16(v.numpy(), got.numpy().view("uint16"))
    assert torch.equal(got, v.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 2, 6])
@pytest.mark.parametrize("cols", [0, 32, 96, 160, 300])
def test_bf16_dots_equal_the_float32_dot_of_the_bf16_values(cols, tokens):
    """bf16_dots (vdpbf16ps on AVX512-BF16, generic IR elsewhere; up to DOT_TOKENS tokens a
    pass, accumulators and a tail) against float64 on the same bf16 values, for each row of a
    [3, cols] projection, tokens in another order than their rows."""
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(3, cols, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, cols, generator=gen).to(torch.bfloat16)
    parts = torch.zeros(layer_kernel.PARTS, dtype=torch.int64)
    parts[layer_kernel.W13] = w.data_ptr()
    vb, sel = v.view(torch.int16).numpy().view("uint16"), torch.arange(tokens).flip(0)
    wb, groups, dots = (
        torch.empty(cols, dtype=torch.int16),
        torch.empty(cols // 16 + 1),
        torch.zeros(tokens),
    )
    for r in range(3):
        layer_kernel.bf16_dots(layer_kernel.BF16, parts.numpy(), layer_kernel.W13, r, cols, 3,
                               wb.numpy().view("uint16"), groups.numpy(), vb, sel.numpy(), 0,
                               tokens, dots.numpy())  # fmt: skip
        want = v[sel].double() @ w[r].double()
        torch.testing.assert_close(dots.double(), want, rtol=1e-5, atol=1e-5)


@numba.njit
def _fused_f32_dots(fmt, w, v, sel, tokens, steps, scales, dots):
    for t in range(0, tokens, intrinsics.DOT_TOKENS):
        n = min(intrinsics.DOT_TOKENS, tokens - t)
        if fmt == layer_kernel.BF16:
            intrinsics.bf16_f32_dot_rows(w, v, sel, t, n, steps, scales, dots, t)
        else:
            intrinsics.e4m3_f32_dot_rows(w, v, sel, t, n, steps, scales, dots, t)


@pytest.mark.parametrize("tokens", [1, 2, 4, 6])
@pytest.mark.parametrize("cols", [128, 384, 2048])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_fused_float_dots_equal_the_float64_dot_of_the_decoded_row(fmt, cols, tokens):
    """bf16_f32_dot_rows / e4m3_f32_dot_rows (the AVX2 hosts' float path: the row decoded in
    registers, up to DOT_TOKENS float32 tokens a pass; compiled everywhere) against float64 on
    the decoded values: every e4m3 code but NaN, subnormals and -0 among them, and fp8_block's
    scale per 128 columns; tokens in another order than their rows."""
    gen = torch.Generator().manual_seed(cols + tokens)
    v = torch.randn(tokens, cols, generator=gen)
    if fmt == "bf16":
        w = torch.randn(cols, generator=gen).to(torch.bfloat16)
        code, raw, scales = layer_kernel.BF16, w.view(torch.int16).numpy().view("uint16"), None
        row = w.double()
    else:
        codes = torch.arange(cols) % 256
        codes[(codes & 0x7F) == 0x7F] = 0x80  # e4m3's NaN codes: none in a checkpoint
        codes = codes[torch.randperm(cols, generator=gen)].to(torch.uint8)
        scales = torch.rand(cols // 128, generator=gen) + 0.5
        code, raw = layer_kernel.FP8, codes.numpy()
        row = codes.view(torch.float8_e4m3fn).double() * scales.double().repeat_interleave(128)
    if scales is None:
        scales = torch.ones(1)
    sel, dots = torch.arange(tokens).flip(0), torch.zeros(tokens)
    _fused_f32_dots(code, raw, v.numpy(), sel.numpy(), tokens, cols // intrinsics.F32_STEP,
                    scales.numpy(), dots.numpy())  # fmt: skip
    want = v[sel].double() @ row
    bound = 1e-6 * (v[sel].double().abs() @ row.abs()) + 1e-6  # float32 sums, a few ulps
    assert ((dots.double() - want).abs() <= bound).all(), (dots, want)


@pytest.mark.parametrize("tokens", [1, 3, 6])
# 304: a last partial block of 32 (one group); 32 and 96: no whole block of nvfp4's wide dot
# (64 columns); 128, 192 (an odd count of blocks: the accumulators' last round) and 2048 whole
@pytest.mark.parametrize("cols", [32, 96, 128, 192, 304, 2048])
@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_int_dots_equal_the_float64_dot_of_the_integers(fmt, cols, tokens):
    """int_dots (q8_dot_rows / nvfp4_q8_dot_rows / nvfp4_q8_dot_rows_wide: up to DOT_TOKENS
    tokens a pass over the row, accumulators, a tail) against float64 on the same integers and
    scales, for each row of a [3, cols] projection, tokens in another order than their rows."""
    gen = torch.Generator().manual_seed(cols + tokens)
    v = torch.randn(tokens, cols, generator=gen)
    code = layer_kernel.INT8 if fmt == "int8" else layer_kernel.NVFP4
    vq, vs, vc = layer_kernel.quantized_act(code, tokens, cols)
    for t in range(tokens):
        layer_kernel.quantize_act(code, v[t].numpy(), vq[t], vs[t], vc[t])
    x = q8_0(v).double()  # what the dot reads
    parts = torch.zeros(layer_kernel.PARTS, dtype=torch.int64)
    if fmt == "int8":
        w = torch.randint(-127, 128, (3, cols), generator=gen, dtype=torch.int8)
        row_scale = torch.rand(3, generator=gen) + 0.5
        keep = (w, row_scale)
        parts[layer_kernel.W13], parts[layer_kernel.W13_SCALE] = w.data_ptr(), row_scale.data_ptr()
        rows = w.double() * row_scale.double()[:, None]
    else:
        packed = torch.randint(0, 256, (3, cols // 2), generator=gen, dtype=torch.int16)
        packed = packed.to(torch.uint8)
        scale_codes = torch.randint(0x08, 0x7E, (3, cols // 16), generator=gen, dtype=torch.int16)
        scale_codes = scale_codes.to(torch.uint8)
        tensor_scale = torch.tensor([0.75, 1.25])  # gate's, up's: rows 0-2 are gate's (inter 3)
        keep = (packed, scale_codes, tensor_scale)
        parts[layer_kernel.W13] = packed.data_ptr()
        parts[layer_kernel.W13_SCALE] = scale_codes.data_ptr()
        parts[layer_kernel.W13_SCALE_2] = tensor_scale.data_ptr()
        codes = torch.stack([packed & 15, packed >> 4], -1).flatten(1).long()
        values = torch.from_numpy(layer_kernel.E2M1_INT[codes.numpy()] / 2.0)
        groups = scale_codes.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
        rows = values * groups * 0.75
    buf, dots = torch.empty(max(cols, 16)), torch.zeros(tokens)
    sel = torch.arange(tokens).flip(0)
    for r in range(3):
        layer_kernel.int_dots(code, parts.numpy(), layer_kernel.W13, r, cols, 3, buf.numpy(),
                              vq, vs, vc, sel.numpy(), 0, tokens, dots.numpy())  # fmt: skip
        want = x[sel] @ rows[r]
        # float32 sums of float64-exact products: off by a few ulps of the sum of |products|
        bound = 1e-6 * (x[sel].abs() @ rows[r].abs()) + 1e-6
        assert ((dots.double() - want).abs() <= bound).all(), (dots, want)
    assert keep


@pytest.mark.parametrize("cols", [32, 304, 768, 2048])
@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_quantized_activations_are_the_reference_rounding(fmt, cols):
    """quantize_act's codes and scales are q8_0's exactly (a last partial block, an all-zero
    block); nvfp4's wide layout (whole blocks of 64) holds each block's even elements' codes,
    then its odd ones', each lane's 32-block scale and -WIDE_BIAS times its quads' code sum.
    The pool's kernel compiled first, as in a pool: numba hands a fastmath caller's flag to
    callees that set none, and reciprocals would round some scales one ulp apart."""
    layer_kernel.compile_all()
    gen = torch.Generator().manual_seed(cols)
    v = torch.randn(cols, generator=gen) * torch.rand(cols, generator=gen) * 4
    v[: layer_kernel.Q8_BLOCK] = 0  # d = 0: codes 0
    code = layer_kernel.INT8 if fmt == "int8" else layer_kernel.NVFP4
    q, s, c = (a[0] for a in layer_kernel.quantized_act(code, 1, cols))
    layer_kernel.quantize_act(code, v.numpy(), q, s, c)
    blocks = -(-cols // layer_kernel.Q8_BLOCK)
    d = (F.pad(v, (0, -cols % 32)).view(blocks, 32).abs().amax(1) / 127).numpy()
    wide, lanes = layer_kernel.wide_dot(code, cols), intrinsics.WIDE_LANES
    if wide:
        block = q.reshape(-1, intrinsics.WIDE_BLOCK)
        codes = np.stack([block[:, :32], block[:, 32:]], -1).reshape(-1)  # even, odd: in order
        lane_block = np.array(intrinsics.WIDE_LANE_Q8)
        assert np.array_equal(s.reshape(-1, lanes), d.reshape(-1, 2)[:, lane_block])
        quads = block.astype(np.int32).reshape(len(block), 16, 4).sum(-1)  # [blocks, 16]
        sums = quads.reshape(len(block), 16 // lanes, lanes).sum(1)  # lane l: quads l, l + lanes
        assert np.array_equal(c.reshape(-1, lanes), -intrinsics.WIDE_BIAS * sums)
    else:
        codes = q
        assert np.array_equal(s, d)
    values = torch.from_numpy(codes.astype(np.float32) * np.repeat(d, 32)[:cols])
    assert torch.equal(values, q8_0(v))


def test_each_unit_of_work_is_claimed_once_its_owners_first():
    """_claim: a worker takes its own range of units in order, then what is left of the others'
    (the next worker's first); every unit goes to one worker; start_call zeroes the counters."""
    workers, units = 3, 10  # ranges: worker 0 [0, 3), 1 [3, 6), 2 [6, 10)
    ctrl = control_block(layer_kernel.control_words(workers))
    plan = np.zeros(layer_kernel.HEADER, np.int64)
    plan[layer_kernel.WORKERS] = workers
    for gen in (1, 2):
        layer_kernel.start_call(ctrl, plan.ctypes.data, gen)
        got, victims = {w: [] for w in range(workers)}, [0] * workers
        for w in [0] * 5 + [2] * 6 + [0, 1]:
            left = layer_kernel._units_left(ctrl, 1, units, workers)
            unit, victims[w] = layer_kernel._claim(ctrl, 1, units, w, workers, victims[w])
            assert left == (unit >= 0)  # what the caller reads before it prepares its inputs
            if unit >= 0:
                got[w].append(unit)
        assert got == {0: [0, 1, 2, 3, 4], 1: [], 2: [6, 7, 8, 9, 5]}, gen


@pytest.mark.parametrize("fmt,dtype", KERNEL_CASES)
def test_the_caller_alone_runs_every_unit_no_worker_claimed(fmt, dtype):
    """The caller's share (run_call as worker == WORKERS, what help_and_wait runs) takes every
    unit the workers left, here all of them (no worker serves this control block): both
    phases, the barrier passed on its own units, the result the reference's."""
    from ft.engine.cpu.layer import LayerCalls

    hidden, inter = SHAPES[1]
    bank, (w13, w2) = bank_for(fmt, dtype, hidden, inter, seed=11)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(2, 3, seed=5)
    calls = LayerCalls(["unserved-0", "unserved-1"], [])  # no thread serves it, none pinned
    handle = calls.submit_routed(x, bank, fmt, ids, weights, list(range(EXPERTS)))
    plan = handle._keep[0]
    scratch = np.empty(layer_kernel.scratch_bytes(plan) + layer_kernel.SCRATCH_ALIGN, np.uint8)
    ran = layer_kernel.run_call(plan, 2, calls.ctrl, handle.gen, scratch.ctypes.data, 0)
    rows1, blocks1, rows2, units2 = layer_kernel.phase_units(plan)
    assert ran == plan[layer_kernel.EXPERTS] * blocks1 + units2
    _assert_kernel_result(handle._out, fmt, bank, x, w13, w2, ids, weights)


def test_only_a_caller_with_a_core_of_its_own_helps():
    """A pool that leaves the caller a core: the caller's wait computes what is left (possibly
    nothing: the workers start first), the result the reference's. Where every core has a
    worker the caller only waits: it would take a worker's time."""
    from ft import cpuinfo

    allowed = cpuinfo.allowed_cores()
    bank, (w13, w2) = bank_for("bf16", torch.float32, *SHAPES[2], seed=3)
    x = torch.randn(1, SHAPES[2][0])
    ids, weights = routing(1, 3, seed=3)
    want = reference(x, w13, w2, ids, weights, 0, False)
    for threads, helps in ((max(1, len(allowed) - 1), len(allowed) > 1), (len(allowed), False)):
        with CpuMoeExecutor(threads=threads) as pool:
            assert pool._layer.caller_helps == helps
            units = 0
            for _ in range(20):
                handle = pool.submit_routed(x, bank, "bf16", ids, weights, list(range(EXPERTS)))
                torch.testing.assert_close(handle.wait(), want, rtol=1e-4, atol=1e-5)
                units += handle.caller_units
            if not helps:
                assert units == 0


@pytest.mark.parametrize(
    "experts,hidden,inter,workers",
    [(1, 2048, 768, 15), (8, 2048, 768, 15), (5, 64, 48, 3), (2, 320, 208, 2)],
)
def test_phase_units_cover_the_rows_about_evenly(experts, hidden, inter, workers):
    plan = np.zeros(layer_kernel.HEADER, np.int64)
    plan[[layer_kernel.EXPERTS, layer_kernel.HIDDEN, layer_kernel.INTER, layer_kernel.WORKERS]] = (
        experts, hidden, inter, workers)  # fmt: skip
    rows1, blocks1, rows2, units2 = layer_kernel.phase_units(plan)
    assert (blocks1 - 1) * rows1 < inter <= blocks1 * rows1  # every row of I, no empty block
    assert (units2 - 1) * rows2 < hidden <= units2 * rows2
    assert rows2 % layer_kernel.OUT_LINE == 0  # phase 2's units write whole lines of out
    want = layer_kernel.UNITS_PER_WORKER * workers
    assert experts * blocks1 >= min(want, experts * inter) // 2


@numba.njit
def _decode_int8(src, out):
    intrinsics.decode_int8(src, out, src.shape[0] // 32)


@numba.njit
def _decode_e4m3(src, out):
    intrinsics.decode_e4m3(src, out, src.shape[0] // 32)


@numba.njit
def _decode_e2m1(src, groups, out):
    intrinsics.decode_e2m1(src, groups, out, src.shape[0] // 16)


@numba.njit
def _decode_e2m1_bf16(src, out):
    intrinsics.decode_e2m1_bf16(src, out, src.shape[0] // 16)


def _as_float(out: torch.Tensor) -> torch.Tensor:
    """A decoded row as float32: bf16 bits (int16) widened, float32 as it is."""
    return out.view(torch.bfloat16).float() if out.dtype == torch.int16 else out


@pytest.mark.parametrize("out_dtype", [torch.int16, torch.float32])  # bf16 bits, float32
def test_row_decoders_give_every_code_exactly(out_dtype):
    """The bf16 dot's and the float path's row decoders: every int8 value, every e4m3 code but
    NaN, every e2m1 code times e4m3 group scales (subnormal ones too), bit for bit: the bf16
    dot's exactness rests on each value fitting bf16."""

    def run(decode, src, *more, n):
        out = torch.empty(n, dtype=out_dtype)
        decode(src.numpy(), *more, out.numpy().view("uint16") if out_dtype == torch.int16
               else out.numpy())  # fmt: skip
        return _as_float(out)

    int8 = torch.arange(-127, 129, dtype=torch.int16).clamp(max=127).to(torch.int8)  # 256
    assert torch.equal(run(_decode_int8, int8, n=256), int8.float())
    e4m3 = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    e4m3[(e4m3 & 0x7F) == 0x7F] = 0  # the two NaN codes
    want = e4m3.view(torch.float8_e4m3fn).float()
    assert torch.equal(run(_decode_e4m3, e4m3, n=256), want)
    packed = torch.arange(256, dtype=torch.int16).to(torch.uint8)  # every pair of codes
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten()
    values = layer_kernel.E2M1_INT[codes.numpy()] / 2.0
    scale_codes = torch.tensor([0x01, 0x07, 0x08, 0x38, 0x7E] * 6 + [0x30, 0x3F], dtype=torch.uint8)
    groups = scale_codes.view(torch.float8_e4m3fn).float()  # 32 groups of 16
    want = torch.from_numpy(values).float() * groups.repeat_interleave(16)
    assert torch.equal(run(_decode_e2m1, packed, groups.numpy(), n=512), want)
    if out_dtype == torch.int16:  # the bf16 dot's nvfp4 decode: values only, scales in its dot
        assert torch.equal(run(_decode_e2m1_bf16, packed, n=512),
                           torch.from_numpy(values).float())  # fmt: skip


@pytest.mark.parametrize("n", [256, 48, 37])  # rows of 4096 and 768 columns' groups; a tail
def test_group_scales_decode_every_e4m3_code_exactly(n):
    """nvfp4's group scales, 16 at a time in vector lanes and the rest one by one: every e4m3
    code but NaN, as torch's float8_e4m3fn reads it (subnormals and signed zeros included)."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].roll(n)  # each length has other codes in its tail
    codes = torch.cat([codes, codes])[:n]
    groups = np.full(n, np.nan, np.float32)
    layer_kernel._group_scales(codes.numpy(), groups)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.from_numpy(groups), want)
    assert torch.equal(torch.from_numpy(groups).signbit(), want.signbit())


def test_calls_in_a_row_and_unrouted_tokens_stay_zero():
    """A second submit before the first's wait; a token no job reads is zero in the result."""
    hidden, inter = SHAPES[0]
    bank, (w13, w2) = bank_for("bf16", torch.bfloat16, hidden, inter, seed=3)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    with CpuMoeExecutor(threads=2) as pool:
        jobs = [
            ExpertJob({k: v[e] for k, v in bank.items()}, torch.tensor([0, 2]),
                      torch.tensor([0.5, 0.25]))
            for e in range(EXPERTS)
        ]  # fmt: skip
        first, second = pool.submit(x, jobs[:2]), pool.submit(x, jobs[2:])
        total = first.wait() + second.wait()
        assert pool.stats.experts_in_pool == EXPERTS
        assert first.ran_on == {f"{THREAD_PREFIX}{k}" for k in range(2)}
    ids = torch.arange(EXPERTS).expand(3, EXPERTS)
    weights = torch.tensor([0.5, 0.0, 0.25])[:, None].expand(3, EXPERTS)
    bf16_dot = act_rounding("bf16", torch.bfloat16, 2) is bf16_round  # AVX512-BF16 hosts
    want = reference(x, w13, w2, ids, weights, bf16_dot=bf16_dot)
    flips = ACT_FLIPS * quant_ref.act_flip(x, w13, w2, ids, weights) if bf16_dot else 0.0
    torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-5 + flips)
    assert torch.equal(total[1], torch.zeros(hidden))


def test_weights_without_a_layer_kernel_run_inline_counted_and_warned_once(ft_log):
    """fp16 experts: the layer kernel reads none, so the caller computes them, visibly."""
    hidden, inter = SHAPES[0]
    bank, (w13, w2) = bank_for("bf16", torch.float16, hidden, inter, seed=5)
    x = torch.randn(1, hidden)
    ids, weights = routing(1, 2, seed=2)
    with CpuMoeExecutor(threads=2) as pool:
        for _ in range(2):
            jobs = expert_jobs(bank, ids, weights, list(range(EXPERTS)), "bf16")
            handle = pool.submit(x, jobs)
            torch.testing.assert_close(handle.wait(), reference(x, w13, w2, ids, weights),
                                       rtol=2e-3, atol=2e-3)  # fmt: skip
        assert pool.stats.experts_inline == 4 and pool.stats.experts_in_pool == 0
    assert handle.ran_on == {threading.current_thread().name}
    warnings = [r for r in ft_log.records if "outside the pool" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "no float16 weights" in warnings[0].getMessage()


def test_mixed_formats_in_one_call_are_refused():
    hidden, inter = SHAPES[0]
    bf16, _ = bank_for("bf16", torch.bfloat16, hidden, inter, seed=1)
    int8, _ = bank_for("int8", None, hidden, inter, seed=1)
    one = (torch.zeros(1, dtype=torch.long), torch.ones(1))
    jobs = [ExpertJob({k: v[0] for k, v in bf16.items()}, *one, "bf16"),
            ExpertJob({k: v[0] for k, v in int8.items()}, *one, "int8")]  # fmt: skip
    with CpuMoeExecutor(threads=1) as pool:
        with pytest.raises(ValueError, match="one expert format"):
            pool.submit(torch.randn(1, hidden), jobs)


def test_stamped_calls_give_each_workers_phases_in_order():
    """With stamping on, each worker stamps its start, prep, barrier arrival and pass, and end:
    in that order, after the caller's publish and before its wait returns; the result is the
    unstamped call's, bit for bit. (The barrier counts phase 1's units, not workers: a worker
    late to its core may arrive after the others passed, its units taken by them.)
    Stamps of two cores are compared with a microsecond's slack (their counters may differ by
    a few cycles); a worker's own stamps, on its one core, with none."""
    hidden, inter = SHAPES[1]
    bank, _ = bank_for("nvfp4", None, hidden, inter, seed=7)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    ids, weights = routing(2, 3, seed=4)
    with CpuMoeExecutor(threads=3) as pool:
        plain = pool.submit_routed(x, bank, "nvfp4", ids, weights, list(range(EXPERTS)))
        want = plain.wait().clone()
        assert plain.phases() is None  # not stamped
        assert pool.stamp_phases()
        handle = pool.submit_routed(x, bank, "nvfp4", ids, weights, list(range(EXPERTS)))
        assert torch.equal(handle.wait(), want)
        stamps = handle.stamps
        assert stamps.shape == (3, layer_kernel.STAMP_COUNT)
        slack = int(phases_module.cycles_per_second() * 1e-6)
        assert (stamps[:, :-1] <= stamps[:, 1:]).all()
        assert (stamps[:, 0] >= handle.published - slack).all()
        assert stamps[:, layer_kernel.FINISHED].max() <= handle.returned + slack
        phases = handle.phases()
        assert sorted(phases.workers) == sorted(phases_module.WORKER_PHASES)
        for name, seconds in phases.workers.items():
            assert seconds.shape == (3,) and (seconds >= -1e-6).all(), name
            assert (seconds <= phases.total_s + 1e-6).all(), name
        assert phases.total_s > 0 and phases.returned_s >= -1e-6
        assert pool.stamp_phases(False)
        again = pool.submit_routed(x, bank, "nvfp4", ids, weights, list(range(EXPERTS)))
        assert torch.equal(again.wait(), want) and again.phases() is None
    with CpuMoeExecutor(threads=1, compute="native") as tasks:
        assert not tasks.stamp_phases()  # the row-block tasks have no phases to stamp


def test_phase_summary_takes_medians_over_calls_of_the_median_and_slowest_worker():
    def call(scale):
        workers = {name: scale * np.array([1e-6, 2e-6, 6e-6]) for name in
                   phases_module.WORKER_PHASES}  # fmt: skip
        return phases_module.CallPhases(workers, returned_s=scale * 1e-6, total_s=scale * 30e-6)

    summary = phases_module.summarize([call(1), call(2), call(10)])
    for name in phases_module.WORKER_PHASES:
        assert summary[name] == {"median_us": 4.0, "max_us": 12.0}
    assert summary["return"] == {"median_us": 2.0} and summary["total"] == {"median_us": 60.0}
    assert summary["phase 1 by worker_us"] == [2.0, 4.0, 12.0]
    assert 1e8 < phases_module.cycles_per_second() < 1e11  # a time-stamp counter's rate


def test_threads_spin_long_only_on_cores_of_their_own(monkeypatch):
    """Where every thread has a core, workers and caller spin FT_CPU_MOE_SPIN_US for the next
    call; a caller sharing a core with a worker hardly spins, and its workers spin briefly (the
    caller needs that core); workers sharing a core hardly spin. With no spin every wait sleeps
    on the futex, and the calls still come out right."""
    from ft import cpuinfo
    from ft.engine.cpu.sync import SHARED_SPIN_S, SHORT_SPIN_S, spin_cycles
    from ft.errors import FtError

    allowed = cpuinfo.allowed_cores()
    with CpuMoeExecutor(threads=len(allowed)) as pool:
        assert pool._layer.caller_spin == spin_cycles(SHARED_SPIN_S)
        assert pool._layer.worker_spin == spin_cycles(SHORT_SPIN_S)
    with CpuMoeExecutor(threads=len(allowed) + 1) as pool:
        assert pool._layer.worker_spin == spin_cycles(SHARED_SPIN_S)
    bank, (w13, w2) = bank_for("bf16", torch.float32, *SHAPES[0], seed=1)
    x = torch.randn(3, SHAPES[0][0])
    ids, weights = routing(3, 2, seed=1)
    want = reference(x, w13, w2, ids, weights, 0, False)
    for spin_us in ("2000", "0"):
        monkeypatch.setenv("FT_CPU_MOE_SPIN_US", spin_us)
        with CpuMoeExecutor(threads=max(1, len(allowed) - 1)) as pool:
            if len(allowed) > 1:
                spin = spin_cycles(float(spin_us) * 1e-6)
                assert pool._layer.caller_spin == pool._layer.worker_spin == spin
            for _ in range(3):
                got = pool.submit_routed(x, bank, "bf16", ids, weights, list(range(EXPERTS)))
                torch.testing.assert_close(got.wait(), want, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("FT_CPU_MOE_SPIN_US", "soon")
    with pytest.raises(FtError, match="FT_CPU_MOE_SPIN_US must be microseconds >= 0, got 'soon'"):
        CpuMoeExecutor(threads=1)


def test_a_caller_on_a_workers_core_leaves_the_units_to_that_worker():
    """The caller helps from a core no worker is pinned to. Where the scheduler runs it on a
    worker's core it only waits: computing there, it left that worker no unit to run and the
    worker spinning at the barrier beside it (the 15-worker H100 box: bf16 9-27% slower)."""

    from ft import cpuinfo

    if len(cpuinfo.allowed_cores()) < 2:
        pytest.skip("one core: the caller never helps")
    bank, (w13, w2) = bank_for("bf16", torch.float32, *SHAPES[2], seed=4)
    x = torch.randn(1, SHAPES[2][0])
    ids, weights = routing(1, 3, seed=4)
    want = reference(x, w13, w2, ids, weights, 0, False)
    with CpuMoeExecutor(threads=len(cpuinfo.allowed_cores()) - 1) as pool:
        assert pool._layer.caller_helps
        with _this_thread_on({pool.cores[0]}):
            for _ in range(20):
                handle = pool.submit_routed(x, bank, "bf16", ids, weights, list(range(EXPERTS)))
                torch.testing.assert_close(handle.wait(), want, rtol=1e-4, atol=1e-5)
                assert handle.caller_units == 0


def test_a_caller_left_on_a_workers_core_is_moved_off_it_and_keeps_its_affinity():
    """The scheduler left the unpinned caller beside a worker for whole runs of calls; a wait
    that finds it there moves it to a free core, its own affinity given back."""
    from ft import cpuinfo

    if len(cpuinfo.allowed_cores()) < 2:
        pytest.skip("one core: the caller never helps")
    bank, (w13, w2) = bank_for("bf16", torch.float32, *SHAPES[2], seed=5)
    x = torch.randn(1, SHAPES[2][0])
    ids, weights = routing(1, 3, seed=5)
    want = reference(x, w13, w2, ids, weights, 0, False)
    before = os.sched_getaffinity(threading.get_native_id())
    with CpuMoeExecutor(threads=len(cpuinfo.allowed_cores()) - 1) as pool:
        for _ in range(5):
            with _this_thread_on({pool.cores[0]}):
                pass  # on the worker's core, free to leave it
            handle = pool.submit_routed(x, bank, "bf16", ids, weights, list(range(EXPERTS)))
            torch.testing.assert_close(handle.wait(), want, rtol=1e-4, atol=1e-5)
            assert cpuinfo.current_cpu() not in pool.cores
            assert os.sched_getaffinity(threading.get_native_id()) == before


@contextmanager
def _this_thread_on(cores: set[int]):
    """The calling thread pinned to `cores` for the block, its affinity restored after."""
    me = threading.get_native_id()
    before = os.sched_getaffinity(me)
    os.sched_setaffinity(me, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(me, before)


def test_a_caller_put_on_its_workers_core_does_not_wait_out_scheduler_slices():
    """The pool spins long where the caller has a free core, but the scheduler may still run the
    unpinned caller on a worker's core (another thread took the free one). Two spinners on one
    core would each wait out the other's whole slice (1.5-4 ms) twice a call; they yield the
    core instead. The margin is the slice's: a call here takes ~50 us, 8 ms without the yield."""
    import statistics
    import time

    from ft import cpuinfo

    allowed = cpuinfo.allowed_cores()
    if len(allowed) < 2:
        pytest.skip("one core: the pool already spins briefly where the caller shares it")
    bank, (w13, w2) = bank_for("bf16", torch.float32, *SHAPES[0], seed=2)
    x = torch.randn(1, SHAPES[0][0])
    ids, weights = routing(1, 1, seed=2)
    want = reference(x, w13, w2, ids, weights, 0, False)
    with CpuMoeExecutor(threads=1) as pool:
        assert pool._layer.caller_spin > 0 and pool._layer.worker_spin > 0  # a core each
        with _this_thread_on(set(pool.cores)):  # the caller beside its worker
            took = []
            for _ in range(25):
                start = time.perf_counter()
                got = pool.submit_routed(x, bank, "bf16", ids, weights, ids[0].tolist()).wait()
                took.append(time.perf_counter() - start)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert statistics.median(took[5:]) < 1e-3, took
