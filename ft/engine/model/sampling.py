"""Sampling parameters and the sampler: greedy, or temperature + top-p with a per-request seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ft.errors import FtError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise FtError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise FtError(f"temperature must not be negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FtError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self) -> torch.Generator | None:
        """The request's own random stream (CPU), so its samples do not depend on its batch."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else random.randrange(2**63)
        return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """logits [B, V] float32 -> one token id per sequence."""
    chosen = logits.argmax(dim=-1).tolist()  # one host sync for the whole batch
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0:
            chosen[i] = _sample_one(logits[i].cpu(), p, gen)
    return chosen


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / p.temperature, dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p  # keeps at least the top one
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
