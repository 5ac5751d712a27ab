"""The expert cache of decode on device gates (offload's default, and hybrid's on CUDA).

The step is one CUDA graph the host follows: at each layer's routing, `follow` marks the uses
(LRU), queues the copies of its misses, names them in the slot table and opens the layer's gate,
then queues the guesses of later layers within the prefetch window. The GPU reads no layer whose
gate is shut, so the host takes slots from any layer but the one it opens and the KEEP_AHEAD
kept after it; a kept layer whose experts all have a slot passes its gate at once. A slot counts
as landed once `ready[slot]` holds its expert's code, written behind the data on the copy's
stream; past a bounded wait the expert is read in place from the host store. Between routings
`top_up` keeps the copy engine fed. docs/decode-step.md has the diagram.
"""

from __future__ import annotations

import itertools
from collections import deque
from contextlib import contextmanager

import torch

from ft.engine.experts.cache import ExpertCache, device_view
from ft.engine.experts.grouped import ON_CPU
from ft.engine.experts.stream_write import stream_writer

RING = 4096  # staging entries of the ready marks: one per copy, reused RING copies later
KEEP_AHEAD = 4  # layers after the one followed whose slots the host keeps

Key = tuple[int, int]  # (layer, expert)


class GatedCache(ExpertCache):
    def __init__(self, store, num_slots: int, device, prefetch_window: int = 0):
        super().__init__(store, num_slots, device, prefetch_window)
        self.replace_held = True  # a nearer layer's guesses replace a farther layer's held ones
        self._finished: int | None = None  # inside follow(): the layer followed; else None
        self._followed = -1  # the last layer followed in this step (-1: none yet)
        self._later: deque[Key] = deque()  # misses held for the next token, after the guesses
        # [N] the code (layer * E + expert) of the expert whose data each slot holds
        self.ready = torch.full((num_slots,), -1, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        # the marks written from the copy's stream queue where the driver can, else copied
        self._write = stream_writer(self._streams.index) if cuda else None
        self._marks = torch.empty(RING, dtype=torch.int32, pin_memory=cuda)  # copies' sources
        self._mark_items, self._copies = self._marks.numpy(), 0
        # device gates: [layers] int32 the work lists read in place, nonzero once the host has
        # opened the layer's gate in this step; all shut before each step
        self._opened = torch.zeros(len(store.banks), dtype=torch.int32, pin_memory=cuda)
        self.opened = device_view(self._opened, self.device) if cuda else self._opened
        self._opened_items = self._opened.numpy()
        # device gates: [layers] int32 in pinned memory, nonzero for the layers whose slots the
        # host keeps for the rest of the step, so the GPU passes one whose experts all have a
        # slot without its gate; the layers kept: the `keep_ahead` after the one followed
        # (at most a quarter of the MoE layers: the host must have slots of others to take)
        self.keep_ahead = min(KEEP_AHEAD, len(store.moe_layers) // 4)
        self._spared = range(0)  # inside follow(): the layers whose slots gates do not take
        self._kept = torch.zeros(len(store.banks), dtype=torch.int32, pin_memory=cuda)
        self.kept = device_view(self._kept, self.device) if cuda else self._kept
        self._kept_items = self._kept.numpy()
        self._on_cpu: dict[int, list[int]] = {}  # hybrid: layer -> experts marked ON_CPU

    def begin_step(self) -> None:
        """A decode step is about to be queued: every gate shut, the step's first layers kept
        (the victims of a step not yet followed spare them already: `_victims`)."""
        self._opened_items.fill(0)
        self._kept_items.fill(0)
        self._followed = -1
        self._keep_after(-1)

    def _kept_after(self, layer: int) -> range:
        """`layer` (-1: none followed yet) and the `keep_ahead` layers after it: the layers the
        GPU may be in, reading slots without waiting for the host, while the host follows it."""
        return range(layer, layer + 1 + self.keep_ahead)

    def _keep_after(self, layer: int) -> None:
        """Tell the device that `_kept_after(layer)` is kept: the host, following `layer` or a
        later one, takes no slot of theirs in this step (`_victims`). No kept layer where
        keep_ahead is 0: each waits for its gate."""
        if self.keep_ahead:
            kept = self._kept_after(layer)
            self._kept_items[max(kept.start, 0) : kept.stop] = 1

    def top_up(self) -> None:
        """Gates, between two layers' routings: queue held guesses while the prefetch window
        has room, so the copy engine is not left idle until the next `follow`. Slots are taken
        as `follow(last layer followed)` would take them; before a step's first follow, from
        any layer (the last step is done: its logits were read, and every gate is shut)."""
        if not (self.window and (self._held or self._later)):
            return
        with self._following(self._followed):
            self._feed(keep_layer=self._followed)

    def guess_next_token(self, guesses: list[tuple[int, list[int]]]) -> None:
        """The step is done on the device (its last kernels wrote these): queue, within the
        window, copies of the next token's guessed experts of its first layers ((layer,
        experts) each, nearest first), taking any layer's slots: the GPU reads none now (the
        next step, once queued, passes its first layers, kept, without the host)."""
        with self._following(-1, step_done=True):
            for layer, experts in guesses:
                self.prefetch(layer, experts, keep_layer=-1)

    def code(self, layer: int, expert: int) -> int:
        """What `ready[slot]` holds once the slot has this expert's data."""
        return layer * self.store.num_experts + expert

    def follow(
        self, layer: int, experts: list[int], guesses: list[tuple[int, list[int]]],
        on_cpu: list[int] = (),
    ) -> None:  # fmt: skip
        """The GPU has routed `layer` to `experts` and finished every layer before it: mark
        the uses (LRU), queue the copies of this layer's misses and open its gate;
        then queue copies of the guessed experts of later layers (`guesses`: (layer, experts)
        each, nearest first) and, after those, of this layer's misses not copied yet, for the
        next token. Within the prefetch window, what waits is held on the host: the guesses
        first, the misses after; both are dropped once their layer is routed again.
        Hybrid: the misses `on_cpu` are the CPU's: marked ON_CPU in the table, not
        copied, and the gate left shut for the hybrid to open once their share is written."""
        with self._following(layer):
            self._keep_after(layer)  # the victims spare them from here on (`_victims`)
            self._drop_held(layer)
            self._unmark_cpu(layer)
            missing = []
            for expert in experts:
                key = (layer, expert)
                if key not in self._slot_of:
                    missing.append(expert)
                    continue
                self._slot_of.move_to_end(key)  # most recently used
                self._used_prefetch(key)  # no wait: the work list checks the ready marks
            self.misses += len(missing)
            self.misses_by_layer[layer] += len(missing)
            if on_cpu:
                self._mark_cpu(layer, on_cpu)
                cpu = set(on_cpu)
                missing = [e for e in missing if e not in cpu]
            missing = self._copy_now(layer, missing)  # left: no slot to be had
            if not on_cpu:  # the table names the copies: the GPU may go on
                self.open(layer)
            for later, guessed in guesses:
                self.prefetch(later, guessed, keep_layer=layer)
            if not self.window:
                self._submit(layer, missing, keep_layer=layer)
                return
            self._later.extend((layer, e) for e in missing)
            self._feed(keep_layer=layer)

    def open(self, layer: int, value: int = 1) -> None:
        """Open the layer's gate (hybrid: with CPU_SHARE once the CPU's share is written)."""
        self._opened_items[layer] = value

    def _mark_cpu(self, layer: int, experts: list[int]) -> None:
        """Table entries ON_CPU for these misses of `layer`: the device skips them where the
        gate opens with the CPU's share, reads them in place where it does not."""
        self._on_cpu[layer] = list(experts)
        self._table_items[layer, experts] = ON_CPU

    def _unmark_cpu(self, layer: int) -> None:
        """The last step's ON_CPU entries of `layer` back to none (-1), where no copy has named
        a slot there since."""
        for expert in self._on_cpu.pop(layer, ()):
            if self._table_items[layer, expert] == ON_CPU:
                self._table_items[layer, expert] = -1

    @contextmanager
    def _following(self, layer: int, step_done: bool = False):
        """Inside: slots are taken as following `layer` allows (`_victims`); `layer` is the last
        one followed in this step (-1: none, or the step is done on the device)."""
        self._finished = self._followed = layer
        # gates: the layers whose slots are not taken: the one being opened and the kept ones
        # after it; none once the step is done
        self._spared = range(0) if step_done else self._kept_after(layer)
        try:
            yield
        finally:
            self._finished = None

    def _copy_now(self, layer: int, missing: list[int]) -> list[int]:
        """Queue the copies of these misses of `layer`, ahead of every guess still held ->
        the ones no slot could be had for. On the prefetch stream: a slot taken may still be
        written by a guess queued there, and the copy engine serves its copies in order anyway."""
        n = self._evictable(layer, len(missing))
        if n:
            self._queue_loads(layer, missing[:n])
        return missing[n:]

    def _load(self, layer: int, expert: int, non_blocking: bool, stream=None) -> int:
        """As offload's, then the slot's ready mark, queued behind the data on its stream."""
        slot = super()._load(layer, expert, non_blocking, stream)
        code = self.code(layer, expert)
        if self._write is not None:  # no turn of the copy engine (stream_write)
            stream = stream or self._streams.current()
            self._write(stream.cuda_stream, self.ready.data_ptr() + 4 * slot, code)  # int32
            return slot
        i = self._copies = (self._copies + 1) % RING
        self._mark_items[i] = code
        self.ready[slot].copy_(self._marks[i], non_blocking=non_blocking)
        return slot

    def _waiting(self) -> tuple[deque, ...]:
        return (self._held, self._later)

    def _track(self, layer: int, missing: list[int], done) -> None:
        """Nothing: no compute waits on a prefetch's event here (the work list checks the
        ready marks), and a demand copy waits for the whole prefetch stream (`_take_slot`)."""

    def _victims(self):
        """Cached keys whose slots following may take, least recent first: of any layer but the
        one being opened and the kept ones after it (the GPU reads no other layer before its
        gate opens)."""
        return (key for key in self._slot_of if key[0] not in self._spared)

    def _evictable(self, keep_layer: int, want: int) -> int:
        if self._finished is None:
            return super()._evictable(keep_layer, want)
        count = min(len(self._free), want)
        return count + sum(1 for _ in itertools.islice(self._victims(), want - count))

    def _take_slot(self, stream=None) -> int:
        if self._finished is not None:  # following: free slots first, then the victims'
            return self._free.pop() if self._free else self._evict(next(self._victims()))
        if stream is not None and self._prefetch_stream is not None:
            # a demand copy (prefill): a freed slot may still be written by a queued prefetch
            stream.wait_stream(self._prefetch_stream)
        return super()._take_slot(stream)
