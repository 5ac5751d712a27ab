"""Fused decoder kernels: the Triton kernels (under the interpreter, on the CPU) give what the
torch ops give, to float32 rounding in float32 and to a bf16 rounding step or two in bfloat16
(the sum of squares is added in another order); the torch path is what transformers computes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ft.engine.fused import add_rms_norm, qk_norm_rope, rms_norm, rope
from tests.engine.interpreter import run_interpreted


def test_add_rms_norm_adds_then_normalises():
    gen = torch.Generator().manual_seed(0)
    h, delta, w = (torch.randn(3, 16, generator=gen) for _ in range(3))
    new_h, x = add_rms_norm(h, delta, w[0], 1e-6)
    torch.testing.assert_close(new_h, h + delta)
    torch.testing.assert_close(x, rms_norm(h + delta, w[0], 1e-6))
    same_h, x0 = add_rms_norm(h, None, w[0], 1e-6)  # the first layer: nothing to add
    assert same_h is h and torch.equal(x0, rms_norm(h, w[0], 1e-6))


def test_rope_keeps_the_norm_of_each_half_pair():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=gen)
    angle = torch.randn(2, 1, 4, generator=gen)
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    y = rope(x, cos, sin)
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731  # rotation of pairs
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    torch.testing.assert_close(qk_norm_rope(x, None, cos, sin, 1e-6), y)


_INTERPRETED = """
import torch
from ft.engine.experts.grouped import InPlace, plan_blocks
from ft.engine.fused import add_rms_norm, qk_norm_rope, route_topk

gen = torch.Generator().manual_seed(3)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    h = torch.randn(4, 40, generator=gen).to(dtype)
    delta, w = torch.randn(4, 40, generator=gen).to(dtype), torch.rand(40, generator=gen).to(dtype)
    fused = add_rms_norm(h, delta, w, 1e-6, "triton")
    for got, want in zip(fused, add_rms_norm(h, delta, w, 1e-6)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    qkv = torch.randn(3, 7, 16, generator=gen).to(dtype)  # 5 q/k heads of a strided qkv, 2 v
    qk, wn = qkv[:, :5], torch.rand(5, 16, generator=gen).to(dtype)
    angle = torch.randn(3, 1, 8, generator=gen)
    cos, sin = (torch.cat((f(angle),) * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    got = qk_norm_rope(qk, wn, cos, sin, 1e-6, "triton")
    torch.testing.assert_close(got, qk_norm_rope(qk, wn, cos, sin, 1e-6), rtol=tol, atol=tol)
    for experts, top_k, norm in ((16, 4, True), (20, 3, False)):  # E not a power of two, too
        logits = torch.randn(5, experts, generator=gen).to(dtype)
        ids, weights = route_topk(logits, top_k, norm, dtype, "triton")
        want_ids, want_weights = route_topk(logits, top_k, norm, dtype)
        assert torch.equal(ids, want_ids), (ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=tol, atol=tol)
        table = torch.randperm(experts, generator=gen).to(torch.int32)  # a cache's slots
        for row in (None, table):
            got, want = plan_blocks(ids, weights, row, "triton"), plan_blocks(ids, weights, row)
            for field in ("tok", "slot", "weight", "block_start", "block_slot"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
            assert got.block_m == want.block_m
        # zero-copy: experts 0, 3, 6.. have no slot, odd ones a slot whose data has not landed
        no_slot = torch.where(torch.arange(experts) % 3 == 0, -1, table).to(torch.int32)
        ready = torch.full((experts,), -7, dtype=torch.int32)
        ready[table[0::2].long()] = 5 * experts + torch.arange(0, experts, 2, dtype=torch.int32)
        misses = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
        got, want = (
            plan_blocks(ids, weights, no_slot, kind, InPlace(experts, m, ready, 5 * experts, False))
            for kind, m in zip(("triton", "torch"), misses)
        )
        for field in ("tok", "slot", "weight", "block_start", "block_slot"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert int(misses[0]) == int(misses[1]) > 0 and (got.slot >= experts).any()
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(120)
def test_triton_fused_kernels_match_torch_under_the_interpreter():
    """Norms and RoPE; the router's top-k (same ids) and the decode work list (the same list,
    field for field, with and without a slot table)."""
    proc = run_interpreted(_INTERPRETED, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
