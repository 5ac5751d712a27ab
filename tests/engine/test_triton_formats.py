"""The Triton expert kernels on every bank format (bf16, int8, fp8_block, nvfp4), under Triton's
CPU interpreter, against a float32 FFN of the dequantised weights; and the test quantiser's
layout against the contract's own examples."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.grouped import blocks_from_groups, reduce_pairs
from ft.engine.experts.grouped import ref_moe_pairs as ref_pairs
from tests.engine.interpreter import run_interpreted
from tests.engine.quant_ref import FORMATS, dequantize, quantize

N, T, K = 4, 4, 2  # slots, tokens, top-k: 8 pairs on 3 live slots, several pairs a slot
SLOT_OF = torch.tensor([2, 0, -1, 3])  # expert -> slot; expert 2 lives elsewhere (dead rows)
SHAPES = {  # fmt -> (D, I): odd where the contract allows, small for the interpreter
    "bf16": (48, 40),
    "int8": (48, 40),
    "fp8_block": (160, 80),  # 2 block columns (and w2 rows); I % 128 != 0: up has its own
    "nvfp4": (96, 48),  # multiples of 16 (the contract), not of the 256 K-chunk
}


def case(fmt: str, dtype: torch.dtype, seed: int = 0):
    """-> bank, x [T, D], ids [T, K] (experts), weights [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    d, inter = SHAPES[fmt]
    w13 = torch.randn(N, 2 * inter, d, generator=gen) / d**0.5
    w2 = torch.randn(N, d, inter, generator=gen) / inter**0.5
    if fmt == "bf16":  # the float format keeps the activations' dtype
        w13, w2 = w13.to(dtype), w2.to(dtype)
    ids = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(T)])
    x = torch.randn(T, d, generator=gen).to(dtype)
    return quantize(w13, w2, fmt), x, ids, torch.rand(T, K, generator=gen)


def check(fmt: str) -> None:
    """fp32 and bf16 activations (each its own tiles); raises on a mismatch. Host-built blocks
    only: fewer programs for the slow interpreter, and the decode work list differs only in
    block metadata, which test_grouped covers."""
    from ft.engine.kernels.moe import triton_moe_pairs

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        bank, x, ids, weights = case(fmt, dtype)
        slots = SLOT_OF[ids]  # [T, K]
        tok = torch.arange(T).repeat_interleave(K)
        float_bank = dict(zip(("w13", "w2"), dequantize(bank, fmt), strict=True))  # this file's
        expected = ref_pairs(x, float_bank, tok, slots.flatten(), weights.flatten())  # quantiser
        groups = group_by_expert(ids, weights, N)
        blocks = blocks_from_groups(groups, [int(SLOT_OF[g.expert]) for g in groups], "cpu")
        assert (blocks.block_slot < 0).any()  # a dead block is exercised
        got = reduce_pairs(blocks, triton_moe_pairs(x, bank, blocks, fmt), T)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"{fmt} {dtype}")
        # reads in place: experts 0 and 3 read in place from a host bank (row = expert), their
        # slots (2 and 3) zeroed so that reading them instead would show
        host = {k: torch.zeros_like(v) for k, v in bank.items()}
        for expert, slot in enumerate(SLOT_OF.tolist()):
            for k in host:
                host[k][expert] = bank[k][max(slot, 0)]
        cache = {k: v.clone() for k, v in bank.items()}
        for k in cache:
            cache[k][[2, 3]] = 0
        slots = [N + g.expert if g.expert in (0, 3) else int(SLOT_OF[g.expert]) for g in groups]
        blocks = blocks_from_groups(groups, slots, "cpu")
        got = reduce_pairs(blocks, triton_moe_pairs(x, cache, blocks, fmt, host), T)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"{fmt} {dtype} host")


_CHILD = """
import json, traceback
from tests.engine.test_triton_formats import FORMATS, check
for fmt in FORMATS:
    try:
        check(fmt)
        print(json.dumps({fmt: "ok"}))
    except Exception:
        print(json.dumps({fmt: traceback.format_exc()[-3000:]}))
"""


@pytest.fixture(scope="module")
def interpreted():
    """fmt -> "ok" or the failure, from one child process for all formats (TRITON_INTERPRET=1
    must be set before triton is imported; one import instead of one a format)."""
    proc = run_interpreted(_CHILD, timeout=280)
    results = {}
    for line in proc.stdout.splitlines():
        results.update(json.loads(line))
    return results, proc.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_match_the_dequantised_reference_under_the_interpreter(fmt, interpreted):
    results, stderr = interpreted
    assert results.get(fmt) == "ok", results.get(fmt) or stderr


def test_a_bank_missing_a_part_or_an_unknown_format_is_an_error():
    from ft.engine.kernels.moe import triton_moe_pairs
    from ft.errors import FtError

    bank, x, ids, weights = case("nvfp4", torch.bfloat16)
    groups = group_by_expert(ids, weights, N)
    blocks = blocks_from_groups(groups, [g.expert for g in groups], "cpu")
    del bank["w2_scale_2"]
    with pytest.raises(FtError, match="nvfp4 expert bank lacks part.s. w2_scale_2"):
        triton_moe_pairs(x, bank, blocks, "nvfp4")
    with pytest.raises(FtError, match="unknown expert format 'fp4'"):
        triton_moe_pairs(x, bank, blocks, "fp4")


def test_int8_is_per_row_symmetric():
    w = torch.tensor([[[1.0, -2.0, 0.5], [0.0, 0.3, -0.6]]])  # [1, 2, 3]
    bank = quantize(torch.cat([w, w], 1), w.transpose(1, 2), "int8")
    assert bank["w13_scale"][0].tolist() == pytest.approx([2 / 127, 0.6 / 127] * 2)
    assert bank["w13"][0, 0].tolist() == [64, -127, 32]


def test_fp8_block_rows_follow_the_contract():
    inter, d = 130, 8  # gate rows 0..129 -> block rows 0, 1; up rows 130..259 -> 2, 3
    w13 = torch.ones(1, 2 * inter, d)
    w13[0, 129], w13[0, 130], w13[0, 259] = 2.0, 3.0, 4.0
    bank = quantize(w13, torch.ones(1, d, inter), "fp8_block")
    assert (bank["w13_scale"][0, :, 0] * 448).tolist() == pytest.approx([1, 2, 3, 4])
    assert bank["w2_scale"].shape == (1, 1, 2)


def test_nvfp4_packs_even_elements_low():
    w = torch.zeros(1, 2, 16)  # gate row, up row; one group of 16 each
    w[0, 0, :4] = torch.tensor([6.0, -0.5, 1.0, 3.0])
    w[0, 1, 0] = 12.0
    bank = quantize(w, torch.zeros(1, 16, 1).expand(1, 16, 16).clone(), "nvfp4")
    assert bank["w13"][0, 0, :2].tolist() == [0x97, 0x52]  # codes 7, 9 (-0.5); 2, 5
    assert bank["w13_scale_2"][0].tolist() == pytest.approx([6 / 2688, 12 / 2688])
    assert bank["w13_scale"][0, :, 0].float().tolist() == [448.0, 448.0]
    w13, _ = dequantize(bank, "nvfp4")
    torch.testing.assert_close(w13, w)
