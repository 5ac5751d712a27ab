"""The device expert cache: N slots shared by all layers, keyed by (layer, expert), LRU.

The slots are a bank laid out as the host store's (an expert's parts side by side, one copy a
miss). Misses are copied on a side stream and prefetches (guesses) on their own, so a miss the
layer waits for never queues behind a guess; the compute stream waits only for the copies it
reads. Which slot holds what is also a table [layers, E] in pinned host memory that the device
reads in place (`slot_table`), so the expert compute never waits for the host and replays from
a CUDA graph; the host writes a layer's row only while no queued compute reads it. A prefetch
window keeps at most N guesses queued on the one copy engine (which serves its queue in order)
and holds the rest on the host, dropped once their layer is routed. On the CPU device a copy is
a plain copy_ (the CPU plays the accelerator in CI).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from contextlib import contextmanager

import torch

from ft.engine.experts.store import HostExpertStore, expert_blocks

_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8", torch.float32: "<f4"}


class _Pinned:
    """The CUDA array interface of a pinned int32, int64 or float32 host tensor: with unified
    addressing, pinned pages' host address is also their device address."""

    def __init__(self, host: torch.Tensor):
        assert host.is_pinned() and host.dtype in _TYPESTR and host.is_contiguous()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False), "version": 3, "strides": None,
        }  # fmt: skip


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory: kernels read it across PCIe, with no copy."""
    return torch.as_tensor(_Pinned(host), device=device)


class _Streams:
    """The current CUDA stream, and switching to another, at a fraction of torch's cost:
    `torch.cuda.current_stream` builds a Stream object at each call (8.9 us on the H200 box) and
    `with torch.cuda.stream(s)` does so twice (15.7 us), where the stream's ids are what is
    needed (measured on the H200 box). A stop calls them on the
    path the GPU waits on."""

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._known: dict[tuple, torch.cuda.Stream] = {}  # (id, device index, type) -> Stream

    def current(self) -> torch.cuda.Stream:
        key = tuple(torch._C._cuda_getCurrentStream(self.index))
        stream = self._known.get(key)
        if stream is None:
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._known[key] = stream
        return stream

    @contextmanager
    def on(self, stream: torch.cuda.Stream):
        """Make `stream` the current one inside the block (as torch.cuda.stream)."""
        before = torch._C._cuda_getCurrentStream(self.index)
        torch.cuda._set_stream_by_id(stream.stream_id, stream.device_index, stream.device_type)
        try:
            yield
        finally:
            torch.cuda._set_stream_by_id(*before)


class _Copied:
    """The completion mark of a prefetch on the CPU device, where copies are done on return."""

    def query(self) -> bool:
        return True


class ExpertCache:
    def __init__(
        self, store: HostExpertStore, num_slots: int, device: torch.device | str,
        prefetch_window: int = 0,
    ):  # fmt: skip
        self.store = store
        self.num_slots = num_slots
        self.device = torch.device(device)
        # part -> [N, ...]: views of one block a slot, laid out as the store's (one copy each)
        self._slot_blocks, self.bank = expert_blocks(num_slots, store.parts, device=self.device)
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.hits = self.misses = self.evictions = self.bytes_fetched = 0
        self.loads = self.prefetched = self.prefetch_hits = 0  # loads: every copy, prefetches too
        # the same two per layer: where in the step the copies fall
        self.loads_by_layer = [0] * len(store.banks)
        self.misses_by_layer = [0] * len(store.banks)
        self._prefetched_keys: set[tuple[int, int]] = set()  # prefetched, not used yet
        # prefetch copies in flight: key -> number of the prefetch that copies it, whose event
        # is in _prefetch_events while the number is above _waited: up to it, the compute
        # stream already waits for them or they are done (events are dropped in order)
        self._in_flight: dict[tuple[int, int], int] = {}
        self._prefetch_events: dict[int, torch.cuda.Event] = {}
        self._prefetches = self._waited = 0
        self.window = prefetch_window  # prefetched experts queued on the copy engine; 0: all
        self._held: deque[tuple[int, int]] = deque()  # guesses kept on the host, nearest first
        # True: a layer's guesses replace those held for it from a farther layer (gates)
        self.replace_held = False
        self._queued: deque[tuple[torch.cuda.Event | _Copied, int]] = deque()  # (done, experts)
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self._prefetch_stream = torch.cuda.Stream(self.device) if cuda else None
        self._streams = _Streams(self.device) if cuda else None
        # each slot's parts and each expert's as views made once: indexing a bank costs ~2 us
        # a part, at each copy
        self._slot_parts = [[part[s] for part in self.bank.values()] for s in range(num_slots)]
        self._slot_block_rows = [[self._slot_blocks[s]] for s in range(num_slots)]
        # (layer, expert) -> (whole block?, its host views to copy)
        self._expert_parts: dict[tuple[int, int], tuple[bool, list[torch.Tensor]]] = {}
        shape = (len(store.banks), store.num_experts)  # [layers, E]
        self._table = torch.full(shape, -1, dtype=torch.int32, pin_memory=cuda)
        self.slot_table = device_view(self._table, self.device) if cuda else self._table
        # the host writes the table through a numpy view of the same memory: an item assignment
        # there costs ~0.2 us against ~6 us for a tensor's, twice per load, at every stop
        self._table_items = self._table.numpy()

    def ensure(self, layer: int, experts: list[int]) -> list[int]:
        """Slots holding these experts of `layer`, fetching the misses. len(experts) <= slots."""
        assert len(experts) <= self.num_slots, "dispatch chunks experts to the cache size"
        self._drop_held(layer)
        slots: list[int | None] = []
        missing = []
        for expert in experts:
            slot = self._slot_of.get((layer, expert))
            if slot is None:
                missing.append((len(slots), expert))
            else:
                self._slot_of.move_to_end((layer, expert))  # most recently used
                self.hits += 1
                self._wait_if_prefetched((layer, expert))
            slots.append(slot)
        if missing:
            self.misses += len(missing)
            self.misses_by_layer[layer] += len(missing)
            self._fetch(layer, missing, slots)
        # held guesses are fed at the next prefetch, once the next compute is launched
        return slots  # type: ignore[return-value]

    def prefetch(self, layer: int, experts: list[int], keep_layer: int) -> None:
        """Start copying the absent ones of these experts of `layer` into slots, ahead of need;
        the compute stream waits for them only if `ensure` later asks for them. Stops rather
        than evict an expert of `keep_layer` (the layer whose compute is queued next).

        The copies do not wait for the compute stream: it may already run the next stretch,
        and the only queued work that reads slots is keep_layer's, which is never evicted;
        older reads ended at the host sync that preceded this stop."""
        missing = [e for e in dict.fromkeys(experts) if (layer, e) not in self._slot_of]
        if not self.window:
            self._submit(layer, missing, keep_layer)
            return
        if self.replace_held:  # the nearer layer's guess: the held ones of `layer` are dropped
            kept = [key for key in self._held if key[0] != layer]
            self._held.clear()
            self._held.extend(kept)
        held = set(self._held)
        self._held.extend((layer, e) for e in missing if (layer, e) not in held)
        self._feed(keep_layer)

    def _feed(self, keep_layer: int) -> None:
        """Queue held guesses on the copy engine, nearest first, while fewer than `window`
        prefetched experts are still being copied."""
        while self._queued and self._queued[0][0].query():  # in order: the oldest ends first
            self._queued.popleft()
        in_flight = sum(n for _, n in self._queued)
        for held in self._waiting():
            while held and in_flight < self.window:
                layer, expert = held.popleft()
                if (layer, expert) not in self._slot_of:
                    in_flight += self._submit(layer, [expert], keep_layer)

    def _waiting(self) -> tuple[deque, ...]:
        """The queues of experts held on the host, the first fed first."""
        return (self._held,)

    def _drop_held(self, layer: int) -> None:
        """Forget the experts of `layer` held on the host: its routing is known now."""
        for held in self._waiting():
            if any(key[0] == layer for key in held):
                kept = [key for key in held if key[0] != layer]
                held.clear()
                held.extend(kept)

    @property
    def held(self) -> list[tuple[int, int]]:
        """(layer, expert) guesses waiting on the host for room in the prefetch window."""
        return list(self._held)

    def _submit(self, layer: int, missing: list[int], keep_layer: int) -> int:
        """Start copying these absent experts of `layer` -> how many were started."""
        missing = missing[: self._evictable(keep_layer, len(missing))]
        if not missing:
            return 0
        self.prefetched += len(missing)
        self._prefetched_keys.update((layer, e) for e in missing)
        self._queue_loads(layer, missing)
        if self._prefetch_stream is None:
            done = _Copied()
        else:  # the mark of their end
            done = torch.cuda.Event()
            done.record(self._prefetch_stream)
            self._track(layer, missing, done)
        if self.window:
            self._queued.append((done, len(missing)))
        return len(missing)

    def _queue_loads(self, layer: int, experts: list[int]) -> None:
        """Queue these experts' copies into slots on the prefetch stream (on the CPU device:
        copy them now)."""
        if self._prefetch_stream is None:
            for expert in experts:
                self._load(layer, expert, non_blocking=False)
            return
        with self._streams.on(self._prefetch_stream):
            for expert in experts:
                self._load(layer, expert, non_blocking=True)

    def _track(self, layer: int, missing: list[int], done: torch.cuda.Event) -> None:
        """Remember which prefetch copies these experts, for a compute or a miss's copy that
        must wait for it (`_wait_for_prefetch`)."""
        self._prefetches += 1
        self._in_flight.update(((layer, e), self._prefetches) for e in missing)
        events = self._prefetch_events  # in order: the oldest first, and first done
        while events:  # drop the done ones: O(dropped) and one query, not a scan of the keys
            n, event = next(iter(events.items()))
            if n > self._waited and not event.query():
                break
            self._waited = max(self._waited, n)  # done: nothing to wait for up to n
            del events[n]
        events[self._prefetches] = done

    def _evictable(self, keep_layer: int, want: int) -> int:
        """How many of `want` slots can be taken before one holding an expert of keep_layer."""
        count = min(len(self._free), want)
        for layer, _ in itertools.islice(self._slot_of, want - count):  # least recent first
            if layer == keep_layer:
                break
            count += 1
        return count

    def _used_prefetch(self, key: tuple[int, int]) -> bool:
        """Whether key was prefetched and not used since: then it counts as a prefetch hit."""
        if key not in self._prefetched_keys:
            return False
        self.prefetch_hits += 1
        self._prefetched_keys.discard(key)
        return True

    def _wait_if_prefetched(self, key: tuple[int, int]) -> None:
        if self._used_prefetch(key) and key in self._in_flight:
            self._wait_for_prefetch(key, self._streams.current(), compute=True)

    def _wait_for_prefetch(self, key: tuple[int, int], stream, compute: bool = False) -> None:
        """Make `stream` wait until key's prefetch copy is done, if it may still be running.
        The prefetch stream is in order: waiting for prefetch n covers every earlier one."""
        n = self._in_flight.pop(key, 0)
        if n <= self._waited:
            return
        event = self._prefetch_events[n]
        if event.query():  # copied already (as are the ones before it): nothing to wait for
            self._waited = n
            return
        stream.wait_event(event)
        if compute:  # the compute stream waits for prefetches 1..n from now on
            self._waited = n

    def _fetch(self, layer: int, missing: list[tuple[int, int]], slots: list) -> None:
        if self._copy_stream is None:
            for i, expert in missing:
                slots[i] = self._load(layer, expert, non_blocking=False)
            return
        compute = self._streams.current()
        self._copy_stream.wait_stream(compute)  # queued reads of evicted slots finish first
        with self._streams.on(self._copy_stream):
            for i, expert in missing:
                slots[i] = self._load(layer, expert, non_blocking=True, stream=self._copy_stream)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)  # the compute stream waits; the host does not

    def _load(self, layer: int, expert: int, non_blocking: bool, stream=None) -> int:
        slot = self._take_slot(stream)
        sources = self._expert_parts.get((layer, expert))
        if sources is None:  # the expert's block whole, else its parts in the bank's order
            blocks = self.store.blocks[layer] if self.store.blocks else None
            if blocks is not None and blocks.shape[1] == self._slot_blocks.shape[1]:
                sources = (True, [blocks[expert]])
            else:
                host = self.store.banks[layer]
                sources = (False, [host[name][expert] for name in self.bank])
            self._expert_parts[layer, expert] = sources
        whole, parts = sources
        targets = self._slot_block_rows[slot] if whole else self._slot_parts[slot]
        for dst, src in zip(targets, parts, strict=True):
            dst.copy_(src, non_blocking=non_blocking)
        self._slot_of[(layer, expert)] = slot
        self._table_items[layer, expert] = slot
        self.loads += 1
        self.loads_by_layer[layer] += 1
        self.bytes_fetched += self.store.expert_bytes
        return slot

    def _take_slot(self, stream=None) -> int:
        """A free slot, or the least recently used one's; `stream` (a miss's copy stream) first
        waits for a prefetch copy that may still be writing that slot."""
        if self._free:
            return self._free.pop()
        return self._evict(next(iter(self._slot_of)), stream)  # the least recently used

    def _evict(self, key: tuple[int, int], stream=None) -> int:
        """Take key's slot: its table entry cleared at once -> the slot."""
        slot = self._slot_of.pop(key)
        self._table_items[key] = -1
        self._prefetched_keys.discard(key)  # prefetched and never used: wasted
        if stream is not None:
            self._wait_for_prefetch(key, stream)
        else:  # the prefetch stream itself: its copies are in order
            self._in_flight.pop(key, None)
        self.evictions += 1
        return slot

    def cached(self) -> list[tuple[int, int]]:
        """(layer, expert) keys from least to most recently used."""
        return list(self._slot_of)

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._slot_of.get((layer, expert))
