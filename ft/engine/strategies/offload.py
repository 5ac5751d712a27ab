"""`offload --no-moe-gates`: experts in (pinned) host memory, an N-slot device cache; a miss is
copied into a slot, then computed on the device, at a host stop per MoE layer. (Offload's
default, device gates, builds on it: ft.engine.strategies.gated.)

Decode, per layer: one host sync (the router's ids, to learn which experts miss), the misses'
copies on the cache's side stream, their slots written in the cache's slot table (`prepare`),
then one batched compute that looks its slots up there (`compute`, capturable in a CUDA graph).
With graphs, a stop can also start fetching the guessed misses of the next `prefetch_depth`
layers (`prefetch`).
Prefill, or a layer needing more experts than slots: grouped on the host, in chunks of slots.
"""

from __future__ import annotations

import torch

from ft.engine.experts.cache import ExpertCache
from ft.engine.experts.grouped import plan_blocks
from ft.engine.strategies.base import MoeStrategy


class OffloadStrategy(MoeStrategy):
    name = "offload"
    host_stop = True
    cache_type = ExpertCache

    def __init__(
        self, store, device, num_slots: int, prefetch_depth: int | tuple[int, int] = 2,
        prefetch_window: int = 0,
    ):  # fmt: skip
        super().__init__(store, device)
        self.cache = self.cache_type(store, num_slots, device, prefetch_window)
        # at a stop, also fetch what the next layers' routers guess from this layer's input:
        # (at batch 1, at larger batches) layers ahead, or one depth for both
        depths = prefetch_depth if isinstance(prefetch_depth, tuple) else (prefetch_depth,) * 2
        self.prefetch_depths = depths
        self.prefetch_depth = max(depths)  # what the decode graphs' buffers hold room for

    def depth_at(self, batch: int) -> int:
        return self.prefetch_depths[0 if batch == 1 else 1]

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):
            return super().forward(layer, x, topk_ids, topk_weights)
        self.prepare(layer, topk_ids.tolist(), x, topk_weights)  # the layer's one host sync
        return self.compute(layer, x, topk_ids, topk_weights)

    def decode_fits(self, pairs: int) -> bool:
        return super().decode_fits(pairs) and pairs <= self.cache.num_slots

    def prepare(self, layer: int, topk_ids: list[list[int]], x=None, topk_weights=None) -> None:
        experts = sorted({e for row in topk_ids for e in row})
        self.expert_uses += len(experts)
        self.cache.ensure(layer, experts)

    def prefetch(self, layer: int, topk_ids: list[list[int]], keep_layer: int) -> None:
        self.cache.prefetch(layer, [e for row in topk_ids for e in row], keep_layer)

    def compute(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        return self.device_share(layer, x, topk_ids, topk_weights, x.dtype)

    def device_share(self, layer, x, topk_ids, topk_weights, dtype=torch.float32):
        """-> [T, D] in `dtype`: the layer's experts that hold a slot, from the slot table row
        written at the stop (an expert with none, -1, is skipped)."""
        table = self.cache.slot_table[layer]  # [E] expert -> slot
        blocks = plan_blocks(topk_ids, topk_weights, table, self.kernel)
        return self.run_blocks(x, self.cache.bank, blocks, dtype=dtype)

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
            cache_hits=c.hits, cache_misses=c.misses, experts_fetched=c.loads,
            bytes_fetched=c.bytes_fetched, experts_cpu=0, experts_cpu_inline=0,
            expert_uses=self.expert_uses, experts_prefetched=c.prefetched,
            prefetch_hits=c.prefetch_hits,
        )  # fmt: skip
