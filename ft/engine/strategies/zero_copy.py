"""`offload --moe-zero-copy`: offload whose decode never stops for the host.

The expert kernels read each routed expert from its cache slot, or, where it has none, from the
pinned host store in place (zero-copy, across PCIe), so the decode step is one CUDA graph the
GPU runs through. The host follows it layer by layer (`follow`, from the routing each layer
writes to pinned memory: ft.engine.graphs), keeping the cache warm for later layers and tokens
(ft.engine.experts.zero_copy). Offload's host stop, by contrast, holds the GPU at every MoE
layer until the host has read its ids and fetched its misses.

The experts read in place are counted on the device (the work-list kernel); they are misses,
and their bytes crossed PCIe like a copy's. Prefill fetches on demand, as offload does.
"""

from __future__ import annotations

import torch

from ft.engine.experts.grouped import InPlace, plan_blocks
from ft.engine.experts.zero_copy import ZeroCopyCache
from ft.engine.strategies.base import MoeStrategy
from ft.engine.strategies.offload import OffloadStrategy


class ZeroCopyOffloadStrategy(OffloadStrategy):
    host_stop = False
    host_follows = True
    cache_type = ZeroCopyCache

    def __init__(
        self, store, device, num_slots: int, prefetch_depth: int = 2, prefetch_window: int = 0
    ):
        super().__init__(store, device, num_slots, prefetch_depth, prefetch_window)
        self._in_place = torch.zeros(1, dtype=torch.long, device=device)  # experts read in place
        self._followed_uses = 0  # expert uses at decode (prefill's are the cache's hits + misses)

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):  # prefill: grouped and fetched, as offload
            return super().forward(layer, x, topk_ids, topk_weights)
        out = self.compute(layer, x, topk_ids, topk_weights)
        self.follow(layer, topk_ids.tolist(), [])  # eager decode: after the layer (a sync)
        return out

    def decode_fits(self, pairs: int) -> bool:
        return MoeStrategy.decode_fits(self, pairs)  # a miss needs no slot: any cache size

    def device_share(self, layer, x, topk_ids, topk_weights, dtype=torch.float32):
        """-> [T, D] in `dtype`: every routed expert, from its slot or in place from the host."""
        cache = self.cache
        table = cache.slot_table[layer]  # [E] expert -> slot, -1: none (read in place)
        in_place = InPlace(cache.num_slots, self._in_place, cache.ready, cache.code(layer, 0))
        blocks = plan_blocks(topk_ids, topk_weights, table, self.kernel, in_place)
        return self.run_blocks(x, cache.bank, blocks, self.store.banks[layer], dtype)

    def follow(self, layer: int, topk_ids: list[list[int]], guesses: list[tuple]) -> None:
        """The GPU has routed `layer` (ids [T][K]) and finished the layers before it; guesses:
        (later layer, ids [T][K]) its router picked for the next layers, nearest first."""
        experts = sorted({e for row in topk_ids for e in row})
        self.expert_uses += len(experts)
        self._followed_uses += len(experts)
        later = [(cut, [e for row in ids for e in row]) for cut, ids in guesses]
        self.cache.follow(layer, experts, later)

    def device_counters(self) -> list[torch.Tensor]:
        return [self._in_place]

    def counters(self) -> dict[str, int]:
        c, in_place = self.cache, int(self._in_place.item())  # a sync: once a step, after it
        return dict(
            cache_hits=c.hits + self._followed_uses - in_place, cache_misses=c.misses + in_place,
            experts_fetched=c.loads, experts_in_place=in_place,
            bytes_fetched=c.bytes_fetched + in_place * self.store.expert_bytes,
            experts_cpu=0, experts_cpu_inline=0, expert_uses=self.expert_uses,
            experts_prefetched=c.prefetched, prefetch_hits=c.prefetch_hits,
        )  # fmt: skip
