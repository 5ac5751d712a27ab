"""Decode attention: the one-launch Triton kernel (under the interpreter, on the CPU) stores the
step's K/V where the torch path does and attends to what SDPA gives; FT_DECODE_ATTENTION picks it
only where the layer's fused kernels are Triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ft import settings
from ft.engine.config import EngineConfig
from ft.engine.model.attention import Batch, Span, _attend_decode, decode_backend
from ft.engine.runner import LLMEngine
from tests.engine.interpreter import run_interpreted
from tests.engine.test_graphs import generate


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "triton"),
        ("triton", "triton"),
        ("TRITON", "triton"),
        ("sdpa", "sdpa"),
        ("x", "triton"),
    ],  # fmt: skip
)
def test_decode_attention_setting(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FT_DECODE_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("FT_DECODE_ATTENTION", value)
    assert settings.decode_attention() == expected


def test_triton_decode_only_where_the_fused_kernels_are_triton(monkeypatch):
    monkeypatch.setenv("FT_DECODE_ATTENTION", "triton")
    assert decode_backend("triton", 128) == "triton"
    assert decode_backend("torch", 128) == "sdpa"  # CPU, or CUDA without Triton
    assert decode_backend("triton", 8) == "sdpa"  # tl.dot needs d >= 16
    monkeypatch.setenv("FT_DECODE_ATTENTION", "sdpa")
    assert decode_backend("triton", 128) == "sdpa"


def test_asking_for_triton_on_the_cpu_says_it_stays_sdpa(synth_tiny, monkeypatch, ft_log):
    monkeypatch.setenv("FT_DECODE_ATTENTION", "triton")
    engine = LLMEngine(EngineConfig(model=str(synth_tiny[0]), device="cpu", max_model_len=64))
    assert {layer.decode for layer in engine.model.layers} == {"sdpa"}
    assert "Decode attention: sdpa (FT_DECODE_ATTENTION=triton)" in ft_log.text


_INTERPRETED = """
import torch
from ft.engine.model.attention import Batch, Span, _attend_decode
from ft.engine.kernels.attention import decode_attention

gen = torch.Generator().manual_seed(5)
S, M = 5, 40  # cache slots, max length
slots = torch.tensor([3, 0, 4])
positions = torch.tensor([37, 0, 16])  # 16-key blocks: 2 + 5 keys; only the new key; 1
spans = [Span(int(s), int(p), 1) for s, p in zip(slots, positions)]
batch = Batch(torch.zeros(3, dtype=torch.long), positions, spans, slots)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for H, G, d in ((8, 1, 16), (4, 2, 32)):  # query heads per kv head: 8, 2
        qkv = torch.randn(3, H + 2 * G, d, generator=gen).to(dtype)
        q, k, v = qkv[:, :H], qkv[:, H : H + G], qkv[:, H + G :]  # strided, as in the model
        k_cache, v_cache = (torch.randn(S, M, G, d, generator=gen).to(dtype) for _ in range(2))
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want = _attend_decode(q, k, v, want_k, want_v, batch)  # SDPA
        for name, cache, new in (("k", want_k, k), ("v", want_v, v)):
            assert torch.equal(cache[slots, positions], new), name  # the reference's own store
        got_k, got_v = k_cache.clone(), v_cache.clone()
        out = torch.full((3, H * d), float("nan"), dtype=dtype)
        decode_attention(q, k, v, got_k, got_v, slots, positions, out, d**-0.5, block_n=16)
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (dtype, H, G)
        got_k, got_v = k_cache.clone(), v_cache.clone()  # the layer's path: one 64-key block
        got = _attend_decode(q, k, v, got_k, got_v, batch, "triton")
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (dtype, H, G)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(120)
def test_triton_decode_attention_matches_sdpa_under_the_interpreter():
    """float32 to float32 rounding, bfloat16 to a few bf16 steps; GQA groups of 8 and 2; three
    sequences in scattered slots, at positions 0, a block's end and mid-block; the caches equal
    the torch path's (the new k/v at (slot, pos), nothing else touched)."""
    proc = run_interpreted(_INTERPRETED, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.gpu
def test_cuda_kernel_matches_sdpa_at_qwen3_shapes():
    """bf16, H=32, G=4, d=128 (qwen3-30b-a3b), long and short sequences: tensor-core dots."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, G, d, S, M = 32, 4, 128, 4, 1500  # noqa: N806
    slots = torch.tensor([2, 0, 3], device="cuda")
    positions = torch.tensor([1400, 0, 77], device="cuda")  # 22 blocks; the new key only; 2
    spans = [Span(int(s), int(p), 1) for s, p in zip(slots, positions, strict=True)]
    batch = Batch(torch.zeros_like(slots), positions, spans, slots)
    qkv = torch.randn(3, H + 2 * G, d, generator=gen, device="cuda").bfloat16()
    q, k, v = qkv[:, :H], qkv[:, H : H + G], qkv[:, H + G :]
    cache = torch.randn(2, S, M, G, d, generator=gen, device="cuda").bfloat16()
    want_cache, got_cache = cache.clone(), cache.clone()
    want = _attend_decode(q, k, v, want_cache[0], want_cache[1], batch)
    got = _attend_decode(q, k, v, got_cache[0], got_cache[1], batch, "triton")
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_cuda_triton_decode_gives_sdpa_tokens_eager_and_graphed(synth_tiny, monkeypatch):
    monkeypatch.setenv("FT_DECODE_ATTENTION", "sdpa")
    sdpa, _ = generate(synth_tiny[0], monkeypatch, graphs=False)
    monkeypatch.setenv("FT_DECODE_ATTENTION", "triton")
    eager, _ = generate(synth_tiny[0], monkeypatch, graphs=False)
    graphed, _ = generate(synth_tiny[0], monkeypatch, graphs=True)
    assert eager == sdpa  # float32: ieee dots, no tf32
    assert graphed == eager
