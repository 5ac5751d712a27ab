"""`resident`: every routed expert on the device; every use counts as a cache hit.

Decode never waits for the device: the router's ids stay there, the work list is built there
(`plan_blocks`) and the experts used are counted there, read once per step by counters().
"""

from __future__ import annotations

import torch

from ft.engine.experts.grouped import plan_blocks
from ft.engine.experts.store import block_views
from ft.engine.strategies.base import MoeStrategy


class ResidentStrategy(MoeStrategy):
    name = "resident"
    graph_safe = True

    def __init__(self, store, device: torch.device | str):
        super().__init__(store, device)
        device = torch.device(device)
        same = device.type == "cpu"  # the CPU "device" reads the host store in place
        blocks = store.blocks or [None] * len(store.banks)
        self.banks = [  # per layer: part -> [E, ...], slot = expert id
            b if b is None or same else _to_device(b, blk, store.parts, device)
            for b, blk in zip(store.banks, blocks, strict=True)
        ]
        self._uses_on_device = torch.zeros((), dtype=torch.long, device=device)

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):  # prefill: group on the host (one sync)
            return super().forward(layer, x, topk_ids, topk_weights)
        return self.compute(layer, x, topk_ids, topk_weights)

    def compute(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        # slot = expert id; the plan counts the distinct experts on the device (no sync)
        blocks = plan_blocks(topk_ids, topk_weights, backend=self.kernel, uses=self._uses_on_device)
        return self.run_blocks(x, self.banks[layer], blocks, dtype=x.dtype)

    def run_groups(self, layer, x, groups, out) -> None:
        slots = [g.expert for g in groups]
        self.compute_groups(x, self.banks[layer], groups, slots, out)

    def device_counters(self) -> list[torch.Tensor]:
        return [self._uses_on_device]

    def counters(self) -> dict[str, int]:
        uses = self.expert_uses + int(self._uses_on_device)  # one sync per call, not per layer
        return dict(
            cache_hits=uses, cache_misses=0, experts_fetched=0, bytes_fetched=0,
            experts_cpu=0, experts_cpu_inline=0, expert_uses=uses,
        )  # fmt: skip


def _to_device(bank, blocks, parts, device: torch.device):
    """A layer's bank on the device. The parts are strided views of the layer's blocks: `.to`
    would first gather each into a contiguous host copy (slow, and twice the host memory), so
    the blocks cross once and the parts are read from them as on the host."""
    if blocks is None:  # banks made some other way: part by part
        return {k: t.to(device) for k, t in bank.items()}
    return block_views(blocks.to(device), parts)
