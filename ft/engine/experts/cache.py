"""The device expert cache: N slots shared by all layers, keyed by (layer, expert), LRU.

The slots are a bank like the store's (part name -> [N, ...], the expert format's parts); a
miss copies every part of the expert into its slot.

A miss copies the expert from the host store into a slot on a separate CUDA stream; the
compute stream waits on an event, so only work that needs the expert waits for it. On the
CPU device the copy is a plain copy_ (the CPU plays the accelerator in CI).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ft.engine.experts.store import HostExpertStore


class ExpertCache:
    def __init__(self, store: HostExpertStore, num_slots: int, device: torch.device | str):
        self.store = store
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.bank = {
            name: torch.empty(num_slots, *p.shape, dtype=p.dtype, device=self.device)
            for name, p in store.parts.items()
        }  # part -> [N, ...]
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.hits = self.misses = self.evictions = self.bytes_fetched = 0
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

    def ensure(self, layer: int, experts: list[int]) -> list[int]:
        """Slots holding these experts of `layer`, fetching the misses. len(experts) <= slots."""
        assert len(experts) <= self.num_slots, "dispatch chunks experts to the cache size"
        slots: list[int | None] = []
        missing = []
        for expert in experts:
            slot = self._slot_of.get((layer, expert))
            if slot is None:
                missing.append((len(slots), expert))
            else:
                self._slot_of.move_to_end((layer, expert))  # most recently used
                self.hits += 1
            slots.append(slot)
        if missing:
            self._fetch(layer, missing, slots)
        return slots  # type: ignore[return-value]

    def _fetch(self, layer: int, missing: list[tuple[int, int]], slots: list) -> None:
        if self._copy_stream is None:
            for i, expert in missing:
                slots[i] = self._load(layer, expert, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)  # queued reads of evicted slots finish first
        with torch.cuda.stream(self._copy_stream):
            for i, expert in missing:
                slots[i] = self._load(layer, expert, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)  # the compute stream waits; the host does not

    def _load(self, layer: int, expert: int, non_blocking: bool) -> int:
        slot = self._take_slot()
        host = self.store.banks[layer]
        for name, slots in self.bank.items():
            slots[slot].copy_(host[name][expert], non_blocking=non_blocking)
        self._slot_of[(layer, expert)] = slot
        self.misses += 1
        self.bytes_fetched += self.store.expert_bytes
        return slot

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        _, slot = self._slot_of.popitem(last=False)  # evict the least recently used
        self.evictions += 1
        return slot

    def cached(self) -> list[tuple[int, int]]:
        """(layer, expert) keys from least to most recently used."""
        return list(self._slot_of)

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._slot_of.get((layer, expert))
