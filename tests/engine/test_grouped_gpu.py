"""On CUDA: the Triton kernels against the reference at the qwen3-30b-a3b expert shape, and
the host syncs per MoE layer (resident decode: none; offload: one)."""

from __future__ import annotations

import warnings

import pytest
import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.grouped import blocks_from_groups, blocks_on_device, reduce_pairs
from ft.engine.experts.store import HostExpertStore

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


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("tokens", [1, 4, 24])
def test_triton_matches_reference_on_cuda(dtype, tol, tokens):
    from ft.engine.experts.triton_moe import triton_moe_pairs

    store, x, ids, weights = store_and_routing(tokens, dtype)
    w13, w2 = store.banks[0]["w13"].cuda(), store.banks[0]["w2"].cuda()
    xc, idc, wc = x.cuda(), ids.cuda(), weights.cuda()
    # reference in float32 on the device, per token (faster than ref_moe_pairs at this shape)
    gate, up = torch.einsum("tkrd,td->tkr", w13[idc].float(), xc.float()).chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    expected = (torch.einsum("tkdi,tki->tkd", w2[idc].float(), h) * wc[..., None]).sum(1)
    builders = [blocks_from_groups(g, [x.expert for x in g], "cuda")
                for g in [group_by_expert(idc, wc, E)]]  # fmt: skip
    if tokens * K <= 128:
        builders.append(blocks_on_device(idc, wc))
    for blocks in builders:
        y = triton_moe_pairs(xc, {"w13": w13, "w2": w2}, blocks, "bf16")  # [P, D]
        got = reduce_pairs(blocks, y, tokens)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


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
