"""`offload` on device gates, its default: the decode step is one CUDA graph the host follows,
rather than a host stop per MoE layer (`--no-moe-gates`: ft.engine.strategies.offload).

The host follows the step layer by layer (`follow`, from the routing each layer writes to
pinned memory: ft.engine.graphs), keeping the cache warm (ft.engine.experts.gated). Each
layer's work list first waits on the device for the layer's gate, which the host opens once it
has queued the copies of the layer's misses; the kernels then wait for those copies' ready
marks. The GPU waits where offload's stop would, without a sync and a launch per layer, and
only where a routed expert has no slot: a layer whose slots the host keeps (the few after the
one it follows) goes on at once where the table names them all.

The host counts the misses (as offload does). An expert whose copy lands later than the
kernel's bound (a stalled host) is read in place from the pinned host store instead, counted
on the device, and its bytes added to what crossed PCIe. Prefill fetches on demand.
"""

from __future__ import annotations

import torch

from ft.engine.experts.gated import GatedCache
from ft.engine.experts.grouped import CpuShare, InPlace, plan_blocks
from ft.engine.strategies.base import MoeStrategy
from ft.engine.strategies.offload import OffloadStrategy


class GatedOffloadStrategy(OffloadStrategy):
    host_stop = False
    host_follows = True
    cache_type = GatedCache

    def __init__(
        self, store, device, num_slots: int, prefetch_depth: int | tuple[int, int] = 2,
        prefetch_window: int = 0,
    ):  # fmt: skip
        super().__init__(store, device, num_slots, prefetch_depth, prefetch_window)
        self._in_place = torch.zeros(1, dtype=torch.long, device=device)  # experts read in place

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):  # prefill: grouped and fetched, as offload
            return super().forward(layer, x, topk_ids, topk_weights)
        self.follow(layer, topk_ids.tolist(), [])  # eager decode: the host first (a sync)
        return self.compute(layer, x, topk_ids, topk_weights)

    def decode_fits(self, pairs: int) -> bool:
        return MoeStrategy.decode_fits(self, pairs)  # a miss needs no slot: any cache size

    def device_share(self, layer, x, topk_ids, topk_weights, dtype=torch.float32):
        """-> [T, D] in `dtype`: every routed expert, from its slot or in place from the host."""
        cache = self.cache
        table = cache.slot_table[layer]  # [E] expert -> slot, -1: none (read in place)
        share = self.cpu_share(layer)
        # a captured step (the one the host follows) waits at each layer's gate for the host;
        # with a CPU share the gate is read eagerly too: its value says whether the row is written
        gated = x.is_cuda and torch.cuda.is_current_stream_capturing()
        gate = cache.opened[layer : layer + 1] if gated or share is not None else None
        kept = cache.kept[layer : layer + 1] if gated else None  # passed where nothing misses
        code = cache.code(layer, 0)
        in_place = InPlace(
            cache.num_slots, self._in_place, cache.ready, code, gate=gate, kept=kept, share=share
        )
        blocks = plan_blocks(topk_ids, topk_weights, table, self.kernel, in_place)
        return self.run_blocks(x, cache.bank, blocks, self.store.banks[layer], dtype, share)

    def cpu_share(self, layer: int) -> CpuShare | None:
        """The CPU's share of the layer that its sum adds (hybrid on gates); none here."""
        return None

    def follow(self, layer: int, topk_ids: list[list[int]], guesses: list[tuple], inputs=None):
        """The GPU has routed `layer` (ids [T][K]) and finished the layers before it; guesses:
        (later layer, ids [T][K]) its router picked for the next layers, nearest first;
        inputs: the layer's x and weights where the device holds them (hybrid's need)."""
        experts = sorted({e for row in topk_ids for e in row})
        self.expert_uses += len(experts)
        self.cache.follow(layer, experts, flat_guesses(guesses))

    def begin_step(self) -> None:
        self.cache.begin_step()

    def top_up(self) -> None:
        self.cache.top_up()

    def guess_next_token(self, guesses: list[tuple]) -> None:
        self.cache.guess_next_token(flat_guesses(guesses))

    def device_counters(self) -> list[torch.Tensor]:
        return [self._in_place]

    def counters(self) -> dict[str, int]:
        c, in_place = self.cache, int(self._in_place.item())  # a sync: once a step, after it
        return dict(  # the host counts the misses as it follows (it copies them)
            cache_hits=self.expert_uses - c.misses, cache_misses=c.misses,
            experts_fetched=c.loads, experts_in_place=in_place,
            bytes_fetched=c.bytes_fetched + in_place * self.store.expert_bytes,
            experts_cpu=0, experts_cpu_inline=0, expert_uses=self.expert_uses,
            experts_prefetched=c.prefetched, prefetch_hits=c.prefetch_hits,
        )  # fmt: skip


def flat_guesses(guesses: list[tuple]) -> list[tuple[int, list[int]]]:
    """(layer, ids [T][K]) each -> (layer, the ids of every token in one list) each."""
    return [(layer, [e for row in ids for e in row]) for layer, ids in guesses]
