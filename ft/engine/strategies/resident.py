"""`resident`: every routed expert on the device; every use counts as a cache hit."""

from __future__ import annotations

import torch

from ft.engine.experts.dispatch import add_expert
from ft.engine.strategies.base import MoeStrategy


class ResidentStrategy(MoeStrategy):
    name = "resident"

    def __init__(self, store, device: torch.device | str):
        super().__init__(store)
        device = torch.device(device)
        same = device.type == "cpu"  # the CPU "device" reads the host store in place
        self.w13 = [w if w is None or same else w.to(device) for w in store.w13]
        self.w2 = [w if w is None or same else w.to(device) for w in store.w2]

    def run_groups(self, layer, x, groups, out) -> None:
        w13, w2 = self.w13[layer], self.w2[layer]
        for group in groups:
            add_expert(out, x, group, w13[group.expert], w2[group.expert])

    def counters(self) -> dict[str, int]:
        return dict(
            cache_hits=self.expert_uses, cache_misses=0, experts_fetched=0, bytes_fetched=0,
            experts_cpu=0, experts_cpu_inline=0, expert_uses=self.expert_uses,
        )  # fmt: skip
