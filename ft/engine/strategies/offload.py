"""`offload`: experts in (pinned) host memory, an N-slot device cache; a miss is copied into a
slot, then computed on the device.

Per layer: one host sync (group_by_expert, to learn which experts miss), the misses' copies on
the cache's side stream, then one batched compute over the cache slots (`compute_slots`).
"""

from __future__ import annotations

from ft.engine.experts.cache import ExpertCache
from ft.engine.strategies.base import MoeStrategy


class OffloadStrategy(MoeStrategy):
    name = "offload"

    def __init__(self, store, device, num_slots: int):
        super().__init__(store, device)
        self.cache = ExpertCache(store, num_slots, device)

    def run_groups(self, layer, x, groups, out) -> None:
        step = self.cache.num_slots  # a layer needing more experts than slots goes in chunks
        for start in range(0, len(groups), step):
            chunk = groups[start : start + step]
            slots = self.cache.ensure(layer, [g.expert for g in chunk])
            self.compute_slots(x, chunk, slots, out)

    def compute_slots(self, x, groups, slots: list[int], out) -> None:
        """out += these expert groups, computed on the device from cache slots `slots`
        (slots[i] holds groups[i]'s expert), in one batched compute. Hybrid reuses it."""
        self.compute_groups(x, self.cache.bank, groups, slots, out)

    def counters(self) -> dict[str, int]:
        c = self.cache
        return dict(
            cache_hits=c.hits, cache_misses=c.misses, experts_fetched=c.misses,
            bytes_fetched=c.bytes_fetched, experts_cpu=0, experts_cpu_inline=0,
            expert_uses=self.expert_uses,
        )  # fmt: skip
