"""Fused decoder kernels: the Triton kernels (under the interpreter, on the CPU) give what the
torch ops give, to float32 rounding in float32 and to a bf16 rounding step or two in bfloat16
(the sum of squares is added in another order); the torch path is what transformers computes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ft.engine.model.attention import Rope
from ft.engine.model.fused import add_rms_norm, qk_norm_rope, rms_norm, rotate, route_topk
from tests.engine.interpreter import run_interpreted


def test_add_rms_norm_adds_then_normalises():
    gen = torch.Generator().manual_seed(0)
    h, delta, w = (torch.randn(3, 16, generator=gen) for _ in range(3))
    new_h, x = add_rms_norm(h, delta, w[0], 1e-6)
    torch.testing.assert_close(new_h, h + delta)
    torch.testing.assert_close(x, rms_norm(h + delta, w[0], 1e-6))
    same_h, x0 = add_rms_norm(h, None, w[0], 1e-6)  # the first layer: nothing to add
    assert same_h is h and torch.equal(x0, rms_norm(h, w[0], 1e-6))
    out = (torch.empty(3, 16), torch.empty(3, 16))  # a stretch's handoff buffers
    written = add_rms_norm(h, delta, w[0], 1e-6, out=out)
    assert written[0] is out[0] and torch.equal(out[0], new_h) and torch.equal(out[1], x)


def test_rope_keeps_the_norm_of_each_half_pair():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=gen)
    angle = torch.randn(2, 1, 4, generator=gen)
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    y = rotate(x, cos, sin)
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731  # rotation of pairs
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    rope, positions = Rope(8, 10000.0, 16, "cpu"), torch.tensor([5, 11])
    want = rotate(x, rope.cos[positions][:, None], rope.sin[positions][:, None])
    torch.testing.assert_close(qk_norm_rope(x, None, rope, positions, 1e-6), want)


def test_stacked_routers_pick_each_routers_top_k_and_write_into_strided_rows():
    """A decode stop routes its layer and guesses the next layers' routing in one top-k: each
    router's ids land in their columns of the stop rows, the weights are the first router's."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 3 * 16, generator=gen)  # 3 tokens, 3 routers of 16 experts
    stop, weights = torch.full((4, 3 * 4 + 4), -1), torch.empty(3, 4)  # rows longer than needed
    polled = torch.full((4, 3 * 4 + 2), -1)  # the host's copy of the ids (StopRows)
    route_topk(
        logits, 4, True, torch.float32, routers=3, out=(stop[:3], weights), mirror=polled[:3]
    )
    for r in range(3):
        ids, w = route_topk(logits[:, r * 16 : (r + 1) * 16], 4, True, torch.float32)
        assert torch.equal(stop[:3, r * 4 : (r + 1) * 4], ids)
        if r == 0:
            assert torch.equal(weights, w)
    assert (stop[:3, 12:] == -1).all() and (stop[3] == -1).all()  # nothing past them written
    assert torch.equal(polled[:3, :12], stop[:3, :12])
    assert (polled[:3, 12:] == -1).all() and (polled[3] == -1).all()


_INTERPRETED = """
import torch
from ft.engine.experts.grouped import InPlace, plan_blocks
from ft.engine.model.attention import Rope
from ft.engine.model.fused import add_rms_norm, qk_norm_rope, route_topk

gen = torch.Generator().manual_seed(3)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    h = torch.randn(4, 40, generator=gen).to(dtype)
    delta, w = torch.randn(4, 40, generator=gen).to(dtype), torch.rand(40, generator=gen).to(dtype)
    fused = add_rms_norm(h, delta, w, 1e-6, "triton")
    for got, want in zip(fused, add_rms_norm(h, delta, w, 1e-6)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    qkv = torch.randn(3, 7, 16, generator=gen).to(dtype)  # 5 q/k heads of a strided qkv, 2 v
    qk, wn = qkv[:, :5], torch.rand(5, 16, generator=gen).to(dtype)
    rope, positions = Rope(16, 10000.0, 64, "cpu"), torch.tensor([40, 3, 17])
    got = qk_norm_rope(qk, wn, rope, positions, 1e-6, "triton")  # gathers the tables' rows
    want = qk_norm_rope(qk, wn, rope, positions, 1e-6)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for experts, top_k, norm in ((16, 4, True), (20, 3, False)):  # E not a power of two, too
        logits = torch.randn(5, 3 * experts, generator=gen).to(dtype)  # 3 routers side by side
        stop = torch.full((5, 3 * top_k + 2), -1)  # a handoff's stop rows: longer, strided
        weights = torch.empty(5, top_k, dtype=dtype)
        polled = torch.full((5, 3 * top_k + 1), -1)  # the host's copy (StopRows), strided too
        route_topk(logits, top_k, norm, dtype, "triton", 3, out=(stop, weights), mirror=polled)
        want_ids, want_weights = route_topk(logits, top_k, norm, dtype, routers=3)
        assert torch.equal(stop[:, : 3 * top_k], want_ids), (stop, want_ids)
        assert (stop[:, 3 * top_k :] == -1).all()
        assert torch.equal(polled[:, : 3 * top_k], want_ids) and (polled[:, -1] == -1).all()
        torch.testing.assert_close(weights, want_weights, rtol=tol, atol=tol)
        ids = stop[:, :top_k]  # the routed ids, as a stretch's compute reads them: strided
        table = torch.randperm(experts, generator=gen).to(torch.int32)  # a cache's slots
        some = torch.where(torch.arange(experts) % 4 == 1, -1, table).to(torch.int32)
        for row in (None, table, some):  # some: a few experts without a slot (skipped)
            uses = [torch.zeros((), dtype=torch.long) for _ in range(2)]
            got = plan_blocks(ids, weights, row, "triton", uses=uses[0])
            want = plan_blocks(ids, weights, row, uses=uses[1])
            for field in ("tok", "slot", "weight", "block_start", "block_slot", "row_of"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
            assert got.block_m == want.block_m
            distinct = {e for e in ids.flatten().tolist() if row is None or row[e] >= 0}
            assert int(uses[0]) == int(uses[1]) == len(distinct), (uses, distinct)
        # reads in place: experts 0, 3, 6.. have no slot, odd ones a slot whose data has not landed
        no_slot = torch.where(torch.arange(experts) % 3 == 0, -1, table).to(torch.int32)
        ready = torch.full((experts,), -7, dtype=torch.int32)
        ready[table[0::2].long()] = 5 * experts + torch.arange(0, experts, 2, dtype=torch.int32)
        # with a gate the host has opened already: the same list (the table read twice)
        code = 5 * experts
        for g in (None, torch.ones(1, dtype=torch.int32)):
            misses = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
            got, want = (
                plan_blocks(ids, weights, no_slot, kind, InPlace(experts, m, ready, code, False, g))
                for kind, m in zip(("triton", "torch"), misses)
            )
            for field in ("tok", "slot", "weight", "block_start", "block_slot", "row_of"):
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
