"""`offload` (device gates, its default) and `offload --moe-zero-copy`: offload whose decode step
is one CUDA graph the host follows, rather than a host stop per MoE layer (`--no-moe-gates`).

The host follows the step layer by layer (`follow`, from the routing each layer writes to
pinned memory: ft.engine.graphs), keeping the cache warm for later layers and tokens
(ft.engine.experts.zero_copy). Where a routed expert has no ready slot:
- zero-copy: the expert kernels read it in place from the pinned host store (across PCIe), so
  the GPU never waits for the host; the host copies it in for the next token;
- gates: each layer's work list first waits on the device for the layer's gate, which the host
  opens once it has queued the copies of the layer's misses; the kernels then wait for those
  copies' ready marks. The GPU waits where offload's stop would, without a sync and a launch
  per layer, and only where a routed expert has no slot: a layer whose slots the host keeps
  (the few after the one it follows) goes on at once where the table names them all.
Offload's host stop, by contrast, holds the GPU at every MoE layer until the host has read its
ids, fetched its misses and launched the next stretch.

The experts read in place are counted on the device (the work-list kernel); they are misses,
and their bytes crossed PCIe like a copy's. With gates the host counts the misses (as offload
does); an expert read in place there all the same (its copy later than the kernel's bound)
adds its bytes to what crossed PCIe. Prefill fetches on demand, as offload does.
"""

from __future__ import annotations

from functools import partial

import torch

from ft.engine.experts.grouped import CpuShare, InPlace, plan_blocks
from ft.engine.experts.zero_copy import ZeroCopyCache
from ft.engine.strategies.base import MoeStrategy
from ft.engine.strategies.offload import OffloadStrategy


class ZeroCopyOffloadStrategy(OffloadStrategy):
    host_stop = False
    host_follows = True
    cache_type = ZeroCopyCache

    def __init__(
        self, store, device, num_slots: int, prefetch_depth: int | tuple[int, int] = 2,
        prefetch_window: int = 0, gates: bool = False,
    ):  # fmt: skip
        self.cache_type = partial(ZeroCopyCache, gates=gates)  # what OffloadStrategy builds
        super().__init__(store, device, num_slots, prefetch_depth, prefetch_window)
        self._in_place = torch.zeros(1, dtype=torch.long, device=device)  # experts read in place
        # gates copy in the next token's first layers' guesses at the step's end (round AO in
        # docs/perf.md: layer 0's misses 1.3 -> 0.4 a step); zero-copy reads them in place
        self.guesses_next_token = gates

    @property
    def gates(self) -> bool:
        return self.cache.gates

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):  # prefill: grouped and fetched, as offload
            return super().forward(layer, x, topk_ids, topk_weights)
        if self.gates:  # eager decode: the host follows first (a sync), copying the misses
            self.follow(layer, topk_ids.tolist(), [])
            return self.compute(layer, x, topk_ids, topk_weights)
        out = self.compute(layer, x, topk_ids, topk_weights)
        self.follow(layer, topk_ids.tolist(), [])  # eager decode: after the layer (a sync)
        return out

    def decode_fits(self, pairs: int) -> bool:
        return MoeStrategy.decode_fits(self, pairs)  # a miss needs no slot: any cache size

    def device_share(self, layer, x, topk_ids, topk_weights, dtype=torch.float32):
        """-> [T, D] in `dtype`: every routed expert, from its slot or in place from the host."""
        cache = self.cache
        table = cache.slot_table[layer]  # [E] expert -> slot, -1: none (read in place)
        share = self.cpu_share(layer)
        # a captured step (the one the host follows) waits at each layer's gate for the host;
        # with a CPU share the gate is read eagerly too: its value says whether the row is written
        captured = x.is_cuda and torch.cuda.is_current_stream_capturing()
        gated = self.gates and captured
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
        # with gates the host counts the misses as it follows (it copies them), else the device
        misses = c.misses + (0 if self.gates else in_place)
        return dict(
            cache_hits=self.expert_uses - misses, cache_misses=misses,
            experts_fetched=c.loads, experts_in_place=in_place,
            bytes_fetched=c.bytes_fetched + in_place * self.store.expert_bytes,
            experts_cpu=0, experts_cpu_inline=0, expert_uses=self.expert_uses,
            experts_prefetched=c.prefetched, prefetch_hits=c.prefetch_hits,
        )  # fmt: skip


def flat_guesses(guesses: list[tuple]) -> list[tuple[int, list[int]]]:
    """(layer, ids [T][K]) each -> (layer, the ids of every token in one list) each."""
    return [(layer, [e for row in ids for e in row]) for layer, ids in guesses]
