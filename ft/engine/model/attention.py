"""Attention with GQA, RoPE and a preallocated KV cache of contiguous per-sequence slots.

Legend: T = tokens in the batch, B = sequences, H = query heads, G = kv heads, d = head_dim,
S = cache slots (sequences), M = max_model_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ft import settings
from ft.log import get_logger

log = get_logger("ft.engine")

# Not cuDNN: on Hopper it builds a new graph for every new key length, which costs ~4.5 ms of
# host time per call at decode (measured on the H200: 63% of a decode step's CPU time).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(query, keys, values, mask) -> torch.Tensor:
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)


@dataclass
class Span:
    """One sequence's tokens in a batch: cache slot, first position, token count."""

    slot: int
    start: int
    length: int


@dataclass
class Batch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    spans: list[Span]
    slots: torch.Tensor  # [B] cache slot of each sequence (decode path)
    kv_len: int | None = None  # decode: keys to attend over (padded, masked); None: the longest
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)  # made once per step

    def decode_mask(self, keys: int) -> torch.Tensor:
        """[B, 1, 1, keys] True where a sequence may attend: the same for every layer."""
        if self._decode_mask is None or self._decode_mask.shape[-1] != keys:
            allowed = (
                torch.arange(keys, device=self.positions.device)[None, :] <= self.positions[:, None]
            )
            self._decode_mask = allowed[:, None, None, :]
        return self._decode_mask

    @property
    def is_decode(self) -> bool:
        return all(s.length == 1 for s in self.spans)

    @property
    def last_token_index(self) -> list[int]:
        ends, total = [], 0
        for span in self.spans:
            total += span.length
            ends.append(total - 1)
        return ends


class KVCache:
    """K and V for every layer, preallocated: [L, S, M, G, d] each."""

    def __init__(self, layers, slots, max_len, kv_heads, head_dim, dtype, device):
        shape = (layers, slots, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len
        gib = 2 * self.k.numel() * self.k.element_size() / (1 << 30)
        log.info(f"Allocating {slots * max_len} tokens for KV cache, K + V = {gib:.2f} GiB")

    @staticmethod
    def bytes_needed(layers, tokens, kv_heads, head_dim, dtype) -> int:
        return (
            2 * layers * tokens * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        )


class Rope:
    """Rotary embedding (rotate-half form, as transformers' default rope)."""

    def __init__(self, head_dim: int, theta: float, max_len: int, device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [M, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.cos, self.sin = emb.cos(), emb.sin()  # [M, d]
        self._last: tuple = (None, None, None)  # (positions, dtype, (cos, sin)) of the last call

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin [T, 1, d] at these positions, gathered once per forward: every layer passes
        the same positions tensor (held here, so its identity cannot be reused by another)."""
        last_positions, last_dtype, tables = self._last
        if positions is not last_positions or dtype != last_dtype:
            cos = self.cos[positions].to(dtype)[:, None, :]  # [T, 1, d]
            tables = (cos, self.sin[positions].to(dtype)[:, None, :])
            self._last = (positions, dtype, tables)
        return tables


def decode_backend(kernel: str, head_dim: int) -> str:
    """A layer's decode attention: "triton" (one launch, kernels/attention.py) where its fused
    kernels are Triton, d >= 16 (tl.dot's least) and FT_DECODE_ATTENTION is not sdpa; else
    "sdpa"."""
    wanted = settings.decode_attention() == "triton"
    return "triton" if wanted and kernel == "triton" and head_dim >= 16 else "sdpa"


def attend(q, k, v, k_cache, v_cache, batch: Batch, decode: str = "sdpa") -> torch.Tensor:
    """Write this batch's k/v into the cache, attend; q [T, H, d], k/v [T, G, d] -> [T, H*d].
    decode: "sdpa" | "triton", the decode path (prefill is SDPA either way)."""
    if batch.is_decode:
        return _attend_decode(q, k, v, k_cache, v_cache, batch, decode)
    return _attend_prefill(q, k, v, k_cache, v_cache, batch)


def _attend_prefill(q, k, v, k_cache, v_cache, batch: Batch) -> torch.Tensor:
    out, offset = [], 0
    for span in batch.spans:  # python ints only: no host sync
        n, end = span.length, span.start + span.length
        k_cache[span.slot, span.start : end] = k[offset : offset + n]
        v_cache[span.slot, span.start : end] = v[offset : offset + n]
        keys = k_cache[span.slot, :end].transpose(0, 1)  # [G, end, d]
        values = v_cache[span.slot, :end].transpose(0, 1)
        query = q[offset : offset + n].transpose(0, 1)  # [H, n, d]
        rows = torch.arange(n, device=q.device)[:, None] + span.start
        mask = torch.arange(end, device=q.device)[None, :] <= rows  # [n, end] causal
        o = _sdpa(query, keys, values, mask)
        out.append(o.transpose(0, 1).reshape(n, -1))
        offset += n
    return torch.cat(out)


def _attend_decode(q, k, v, k_cache, v_cache, batch: Batch, backend: str = "sdpa") -> torch.Tensor:
    """One new token per sequence, all sequences in one attention call, padded to the longest."""
    if backend == "triton":
        return _triton_decode(q, k, v, k_cache, v_cache, batch)
    k_cache[batch.slots, batch.positions] = k  # [B, G, d] scattered into their slots
    v_cache[batch.slots, batch.positions] = v
    longest = batch.kv_len or max(s.start for s in batch.spans) + 1  # CUDA graphs fix kv_len
    keys = k_cache[batch.slots, :longest].transpose(1, 2)  # [B, G, longest, d]
    values = v_cache[batch.slots, :longest].transpose(1, 2)
    query = q[:, :, None, :]  # [B, H, 1, d]
    o = _sdpa(query, keys, values, batch.decode_mask(longest))
    return o.reshape(q.shape[0], -1)


def _triton_decode(q, k, v, k_cache, v_cache, batch: Batch) -> torch.Tensor:
    """The same in one Triton launch, over each sequence's own keys (kv_len is not needed)."""
    from ft.engine.kernels import attention as attention_triton

    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    scale = 1 / math.sqrt(q.shape[-1])  # SDPA's default
    attention_triton.decode_attention(
        q, k, v, k_cache, v_cache, batch.slots, batch.positions, out, scale
    )
    return out
