"""What every MoE strategy is: one object the model calls for each MoE layer."""

from __future__ import annotations

import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.store import HostExpertStore


class MoeStrategy:
    """forward(layer, x [T, D], topk_ids [T, K], topk_weights [T, K]) -> [T, D]."""

    name = "base"

    def __init__(self, store: HostExpertStore):
        self.store = store
        self.expert_uses = 0  # (layer, expert) pairs routed to, one per layer per forward

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.store.num_experts)
        self.expert_uses += len(groups)
        out = torch.zeros_like(x)
        self.run_groups(layer, x, groups, out)
        return out

    def run_groups(self, layer, x, groups, out) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Cumulative: cache_hits + cache_misses == expert_uses for every strategy."""
        raise NotImplementedError

    def close(self) -> None:
        pass
