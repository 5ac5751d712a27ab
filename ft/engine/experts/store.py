"""The host expert store: every routed expert of every MoE layer, in host memory.

Layout (the contract): per layer `w13[layer]` [E, 2I, D] (rows 0..I-1 gate / w1, rows I..2I-1
up / w3) and `w2[layer]` [E, D, I]; None for dense layers. Pinned when CUDA is present so
copies into device slots can be asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostExpertStore:
    w13: list[torch.Tensor | None]  # per decoder layer: [E, 2I, D] or None (dense layer)
    w2: list[torch.Tensor | None]  # per decoder layer: [E, D, I] or None
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype

    @classmethod
    def allocate(cls, num_layers, moe_layers, num_experts, hidden, inter, dtype) -> HostExpertStore:
        pin = torch.cuda.is_available()  # pinned pages let the copy stream run asynchronously
        w13: list[torch.Tensor | None] = [None] * num_layers
        w2: list[torch.Tensor | None] = [None] * num_layers
        for layer in moe_layers:
            w13[layer] = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, pin_memory=pin)
            w2[layer] = torch.empty(num_experts, hidden, inter, dtype=dtype, pin_memory=pin)
        return cls(w13, w2, num_experts, hidden, inter, dtype)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, w in enumerate(self.w13) if w is not None]

    @property
    def total_experts(self) -> int:
        return self.num_experts * len(self.moe_layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (w13 + w2), what a cache miss copies."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 3 * self.hidden_size * self.intermediate_size * elem

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.total_experts
