"""On CUDA: the Triton kernels against the reference at the qwen3-30b-a3b expert shape (and, for
the quantised bank formats, seed-next's and an odd one), and the host syncs per MoE layer
(resident decode: none; offload: one)."""

from __future__ import annotations

import warnings

import pytest
import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.grouped import blocks_from_groups, blocks_on_device, reduce_pairs
from ft.engine.experts.store import HostExpertStore
from tests.engine.quant_ref import dequantize, quantize

pytestmark = pytest.mark.gpu
E, K, D, INTER = 128, 8, 2048, 768


def store_and_routing(tokens: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    store = HostExpertStore.allocate(1, [0], E, D, INTER, dtype)
    bank = store.banks[0]
    bank["w13"].copy_(torch.randn(bank["w13"].shape, generator=gen) / D**0.5)
    bank["w2"].copy_(torch.randn(bank["w2"].shape, generator=gen) / INTER**0.5)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    x = torch.randn(tokens, D, generator=gen).to(dtype)
    return store, x, ids, torch.softmax(torch.rand(tokens, K, generator=gen), -1)


def expected_on_device(w13, w2, x, ids, weights):
    """float32 reference on the device, per token (faster than ref_moe_pairs at these shapes)."""
    gate, up = torch.einsum("tkrd,td->tkr", w13[ids].float(), x.float()).chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    return (torch.einsum("tkdi,tki->tkd", w2[ids].float(), h) * weights[..., None]).sum(1)


def assert_kernel_matches(x, bank, fmt, ids, weights, expected, tol, experts=E):
    """Both work-list builders (the decode one where it applies); slot = expert."""
    from ft.engine.kernels.moe import triton_moe_pairs

    groups = group_by_expert(ids, weights, experts)
    builders = [blocks_from_groups(groups, [g.expert for g in groups], "cuda")]
    if ids.numel() <= 128:
        builders.append(blocks_on_device(ids, weights))
    for blocks in builders:
        got = reduce_pairs(blocks, triton_moe_pairs(x, bank, blocks, fmt), x.shape[0])
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"{fmt} {x.dtype}")


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("tokens", [1, 4, 24])
def test_triton_matches_reference_on_cuda(dtype, tol, tokens):
    store, x, ids, weights = store_and_routing(tokens, dtype)
    w13, w2 = store.banks[0]["w13"].cuda(), store.banks[0]["w2"].cuda()
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda()
    expected = expected_on_device(w13, w2, xc, idc, wc)
    assert_kernel_matches(xc, {"w13": w13, "w2": w2}, "bf16", idc, wc, expected, tol)


@pytest.mark.parametrize("fmt", ["int8", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("d, inter, top_k", [(2048, 768, 8), (2560, 640, 10), (160, 144, 4)])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("tokens", [1, 4, 24])
def test_quantised_banks_match_the_dequantised_reference_on_cuda(
    fmt, d, inter, top_k, dtype, tol, tokens
):
    """qwen3-30b-a3b's and seed-next's expert shapes, and an odd one (I % 128 != 0)."""
    experts, gen = 16, torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, d, device="cuda", generator=gen) / d**0.5
    w2 = torch.randn(experts, d, inter, device="cuda", generator=gen) / inter**0.5
    bank = quantize(w13, w2, fmt)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k]
                       for _ in range(tokens)])  # fmt: skip
    weights = torch.softmax(torch.rand(tokens, top_k, device="cuda", generator=gen), -1)
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(dtype)
    expected = expected_on_device(*dequantize(bank, fmt), x, ids, weights)
    assert_kernel_matches(x, bank, fmt, ids, weights, expected, tol, experts)


def syncs_during(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_host_syncs_per_layer():
    from ft.engine.strategies.offload import OffloadStrategy
    from ft.engine.strategies.resident import ResidentStrategy

    store, x, ids, weights = store_and_routing(2, torch.bfloat16)
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda().to(torch.bfloat16)
    resident, offload = ResidentStrategy(store, "cuda"), OffloadStrategy(store, "cuda", 64)
    assert resident.kernel == offload.kernel == "triton"
    resident.forward(0, xc, idc, wc), offload.forward(0, xc, idc, wc)  # compile, fill the cache
    assert syncs_during(lambda: resident.forward(0, xc, idc, wc)) == 0
    assert syncs_during(lambda: offload.forward(0, xc, idc, wc)) == 1
    same = dict(rtol=1e-2, atol=1e-2)  # same kernels; fp32 atomics may sum in another order
    torch.testing.assert_close(
        resident.forward(0, xc, idc, wc), offload.forward(0, xc, idc, wc), **same
    )
