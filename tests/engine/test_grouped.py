"""Batched expert compute: both work-list builders and both backends against the reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.grouped import (
    blocks_from_groups,
    blocks_on_device,
    moe_pairs,
    reduce_pairs,
    ref_moe_pairs,
)
from tests.engine.interpreter import run_interpreted

T, K, N, D, INTER = 5, 3, 7, 32, 16  # tokens, top-k, slots, hidden, intermediate


def bank(gen, dtype=torch.float32):
    w13 = torch.randn(N, 2 * INTER, D, generator=gen, dtype=dtype) / D**0.5
    w2 = torch.randn(N, D, INTER, generator=gen, dtype=dtype) / INTER**0.5
    return w13, w2


def routing(gen, tokens=T):
    ids = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(tokens)])  # [T, K]
    return ids, torch.rand(tokens, K, generator=gen)


def reference(x, w13, w2, ids, weights):
    tok = torch.arange(ids.shape[0]).repeat_interleave(K)
    return ref_moe_pairs(x, {"w13": w13, "w2": w2}, tok, ids.flatten(), weights.flatten())


def torch_pairs(x, w13, w2, blocks):
    return moe_pairs(x, {"w13": w13, "w2": w2}, blocks, "torch", "bf16")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_blocks_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = bank(gen)
    x, (ids, weights) = torch.randn(T, D, generator=gen), routing(gen)
    blocks = blocks_on_device(ids, weights)
    got = reduce_pairs(blocks, torch_pairs(x, w13, w2, blocks), T)
    torch.testing.assert_close(got, reference(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    assert int((blocks.block_slot >= 0).sum()) == len(set(ids.flatten().tolist()))


def test_skipped_slots_contribute_nothing():
    gen = torch.Generator().manual_seed(3)
    w13, w2 = bank(gen)
    x, (ids, weights) = torch.randn(T, D, generator=gen), routing(gen)
    table = torch.tensor([0, -1, 2, -1, 4, 5, -1])  # experts 1, 3, 6 live elsewhere
    blocks = blocks_on_device(table[ids], weights)
    got = reduce_pairs(blocks, torch_pairs(x, w13, w2, blocks), T)
    kept = table[ids] >= 0
    expected = reference(x, w13, w2, torch.where(kept, ids, -1), weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_group_blocks_use_the_given_slots_and_split_big_groups():
    gen = torch.Generator().manual_seed(4)
    w13, w2 = bank(gen)
    tokens = 100  # expert groups larger than one 64-row block
    x, ids = torch.randn(tokens, D, generator=gen), torch.randint(0, 3, (tokens, K), generator=gen)
    weights = torch.rand(tokens, K, generator=gen)
    groups = group_by_expert(ids, weights, 3)
    slots = [6, 2, 4]  # expert e sits in slot slots[e]
    blocks = blocks_from_groups(groups, slots, "cpu")
    assert blocks.block_start.shape[0] > len(groups)
    got = reduce_pairs(blocks, torch_pairs(x, w13, w2, blocks), tokens)
    expected = reference(x, w13, w2, torch.tensor(slots)[ids], weights)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


_INTERPRETED = """
import torch
from ft.engine.experts.grouped import blocks_on_device, blocks_from_groups, reduce_pairs
from ft.engine.experts.dispatch import group_by_expert
from ft.engine.kernels.moe import triton_moe_pairs
from tests.engine.test_grouped import bank, reference, routing, T, D
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
    gen = torch.Generator().manual_seed(5)
    w13, w2 = bank(gen, dtype)
    x, (ids, weights) = torch.randn(T, D, generator=gen).to(dtype), routing(gen)
    expected = reference(x, w13, w2, ids, weights)
    for blocks in (blocks_on_device(ids, weights),
                   blocks_from_groups(group_by_expert(ids, weights, 7),
                                      [g.expert for g in group_by_expert(ids, weights, 7)], "cpu")):
        got = reduce_pairs(blocks, triton_moe_pairs(x, {"w13": w13, "w2": w2}, blocks, "bf16"), T)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    # the one-launch sum over each token's rows, rows of experts without a slot left out (the
    # kernels leave them unwritten: NaN here), in float32 and in the model's dtype
    table = torch.tensor([0, -1, 2, -1, 4, 5, -1])
    blocks = blocks_on_device(table[ids], weights, ids)
    y = triton_moe_pairs(x, {"w13": w13, "w2": w2}, blocks, "bf16")
    y[blocks.slot < 0] = float("nan")
    kept = reference(x, w13, w2, torch.where(table[ids] >= 0, ids, -1), weights)
    for out in (torch.float32, dtype):
        got = reduce_pairs(blocks, y, T, out, "triton")
        assert got.dtype == out
        torch.testing.assert_close(got, kept.to(out), rtol=tol, atol=tol)
        torch.testing.assert_close(got, reduce_pairs(blocks, y, T, out), rtol=tol, atol=tol)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(300)
def test_triton_kernels_match_reference_under_the_interpreter():
    proc = run_interpreted(_INTERPRETED, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
