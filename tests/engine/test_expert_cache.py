"""ExpertCache: LRU eviction order, slot reuse, counters, copied contents; offload chunking."""

from __future__ import annotations

import pytest
import torch

from ft.engine.experts.cache import ExpertCache
from ft.engine.experts.dispatch import add_expert, group_by_expert
from ft.engine.experts.store import HostExpertStore, block_views
from ft.engine.formats import FORMATS
from ft.engine.strategies.offload import OffloadStrategy
from ft.engine.strategies.resident import ResidentStrategy


def make_store(layers=2, experts=6, hidden=8, inter=4) -> HostExpertStore:
    store = HostExpertStore.allocate(layers, range(layers), experts, hidden, inter, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for part in store.banks[layer].values():  # w13 [E, 2I, D], w2 [E, D, I]
            part.copy_(torch.randn(part.shape, generator=gen))
    return store


def test_lru_eviction_order_and_slot_reuse():
    cache = ExpertCache(make_store(), num_slots=3, device="cpu")
    first = cache.ensure(0, [1, 2, 3])
    assert sorted(first) == [0, 1, 2]
    cache.ensure(0, [1])  # 1 becomes most recently used: LRU order is now 2, 3, 1
    assert cache.cached() == [(0, 2), (0, 3), (0, 1)]
    slot_of_2 = cache.slot_of(0, 2)
    (slot,) = cache.ensure(1, [4])  # evicts (0, 2), the least recently used
    assert slot == slot_of_2
    assert cache.slot_of(0, 2) is None
    assert cache.cached() == [(0, 3), (0, 1), (1, 4)]
    assert (cache.hits, cache.misses, cache.evictions) == (1, 4, 1)


def test_slots_hold_the_experts_they_are_keyed_by():
    store = make_store()
    cache = ExpertCache(store, num_slots=2, device="cpu")
    for layer, expert in [(0, 5), (1, 5), (0, 0), (1, 3), (0, 5)]:
        (slot,) = cache.ensure(layer, [expert])
        for part, slots in cache.bank.items():
            assert torch.equal(slots[slot], store.banks[layer][part][expert])
    assert cache.bytes_fetched == cache.misses * store.expert_bytes


def test_hits_do_not_fetch_and_same_call_experts_are_never_evicted():
    cache = ExpertCache(make_store(), num_slots=2, device="cpu")
    cache.ensure(0, [0, 1])
    slots = cache.ensure(0, [1, 2])  # 1 hits; 2 must evict 0, not 1
    assert slots[0] == cache.slot_of(0, 1) and slots[1] == cache.slot_of(0, 2)
    assert cache.slot_of(0, 0) is None
    assert (cache.hits, cache.misses) == (1, 3)


def test_offload_with_fewer_slots_than_a_layer_needs_equals_resident():
    store = make_store()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(5)])  # [T, K]
    weights = torch.rand(5, 3, generator=gen)
    resident, offload = ResidentStrategy(store, "cpu"), OffloadStrategy(store, "cpu", num_slots=2)
    for layer in (0, 1, 0):
        expected = resident.forward(layer, x, ids, weights)
        torch.testing.assert_close(offload.forward(layer, x, ids, weights), expected)
    counters = offload.counters()
    assert counters["cache_hits"] + counters["cache_misses"] == counters["expert_uses"]
    assert counters["expert_uses"] == resident.counters()["expert_uses"]


def test_dispatch_equals_a_per_token_reference():
    store = make_store(layers=1)
    gen = torch.Generator().manual_seed(2)
    x, ids = torch.randn(4, 8, generator=gen), torch.randint(0, 6, (4, 2), generator=gen)
    weights = torch.rand(4, 2, generator=gen)
    out = torch.zeros_like(x)
    groups = group_by_expert(ids, weights, 6)
    assert [g.expert for g in groups] == sorted(set(ids.flatten().tolist()))
    for group in groups:
        add_expert(out, x, group, *_weights(store, group.expert))
    torch.testing.assert_close(out, ref_moe(x, ids, weights, store))


def ref_moe(x, ids, weights, store):
    """One token and one expert at a time: the obvious definition."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(ids.shape[1]):
            w13, w2 = _weights(store, ids[t, k])
            gate, up = (w13 @ x[t]).chunk(2)
            acc += weights[t, k] * (w2 @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


def test_prefetch_loads_ahead_and_counts_a_later_use_as_a_hit():
    cache = ExpertCache(make_store(experts=8), num_slots=4, device="cpu")
    cache.ensure(0, [0, 1])
    cache.prefetch(1, [2, 3, 2], keep_layer=0)  # duplicates fetched once
    assert (cache.prefetched, cache.loads, cache.misses) == (2, 4, 2)
    cache.ensure(1, [2, 5])  # 2 was prefetched: a hit; 5 a miss, evicting layer 0's LRU
    assert (cache.hits, cache.misses, cache.prefetch_hits) == (1, 3, 1)
    assert int(cache.slot_table[1, 2]) == cache.slot_of(1, 2)


def test_prefetch_never_evicts_the_layer_being_computed():
    cache = ExpertCache(make_store(experts=8), num_slots=3, device="cpu")
    cache.ensure(1, [0])
    cache.ensure(0, [0, 1])  # LRU order: (1,0), (0,0), (0,1)
    cache.prefetch(1, [4, 5, 6], keep_layer=0)  # may take (1,0)'s slot, not layer 0's
    assert cache.prefetched == 1
    assert cache.cached() == [(0, 0), (0, 1), (1, 4)]
    assert int(cache.slot_table[1, 0]) == -1  # the evicted entry left the table


class _Copies:
    """Stands in for the copy engine: each prefetch's completion mark reads done only once the
    test says so (on the CPU device copies are done on return)."""

    def __init__(self):
        self.marks: list[_Copies.Mark] = []

    class Mark:
        done = False

        def query(self) -> bool:
            return self.done

    def __call__(self) -> Mark:
        self.marks.append(self.Mark())
        return self.marks[-1]

    def finish(self) -> None:
        for mark in self.marks:
            mark.done = True


@pytest.fixture
def copies(monkeypatch) -> _Copies:
    from ft.engine.experts import cache as cache_module

    fake = _Copies()
    monkeypatch.setattr(cache_module, "_Copied", fake)
    return fake


class _Stream:
    """Records what a stream is made to wait for."""

    def __init__(self):
        self.waited_for = []

    def wait_event(self, event) -> None:
        self.waited_for.append(event)


def test_prefetch_events_are_dropped_in_order_once_done_and_a_dropped_one_is_not_waited_for():
    """A prefetch's event is kept while a compute may still have to wait for it: at each new
    prefetch the oldest are dropped, in order, once done or waited for (a later one done does
    not let an earlier running one go)."""
    cache = ExpertCache(make_store(), 6, "cpu")
    marks = [_Copies.Mark() for _ in range(3)]
    for expert, mark in enumerate(marks):  # prefetches 1, 2, 3 copy experts 0, 1, 2 of layer 0
        cache._track(0, [expert], mark)
    assert list(cache._prefetch_events) == [1, 2, 3]  # none done: all kept
    marks[0].done = marks[2].done = True
    cache._track(1, [0], _Copies.Mark())  # prefetch 4
    assert list(cache._prefetch_events) == [2, 3, 4] and cache._waited == 1  # 2 still runs
    stream = _Stream()
    cache._wait_for_prefetch((0, 0), stream, compute=True)  # prefetch 1: done and dropped
    assert stream.waited_for == []
    cache._wait_for_prefetch((0, 1), stream, compute=True)  # prefetch 2: running, waited for
    assert stream.waited_for == [marks[1]] and cache._waited == 2
    cache._track(1, [1], _Copies.Mark())  # prefetch 5: 2 is waited for, 3 done, 4 runs
    assert list(cache._prefetch_events) == [4, 5] and cache._waited == 3
    cache._wait_for_prefetch((0, 2), stream, compute=True)  # prefetch 3: done, nothing to wait
    assert stream.waited_for == [marks[1]]


def test_a_prefetch_window_holds_guesses_on_the_host_until_copies_end(copies):
    cache = ExpertCache(make_store(layers=3, experts=8), 6, "cpu", prefetch_window=2)
    cache.prefetch(1, [2, 3, 4], keep_layer=0)
    assert cache.prefetched == 2 and cache.held == [(1, 4)]  # 2 copying, 1 held
    cache.prefetch(2, [5, 3], keep_layer=0)  # (2, 3) is another layer's expert 3: a new guess
    assert cache.held == [(1, 4), (2, 5), (2, 3)]  # in the order they came: nearest first
    cache.prefetch(1, [4], keep_layer=0)  # a guess already held is not held twice
    assert cache.held == [(1, 4), (2, 5), (2, 3)]
    copies.finish()
    cache.prefetch(2, [], keep_layer=0)  # the next stop: room for two more, the oldest first
    assert cache.prefetched == 4 and cache.held == [(2, 3)]
    assert cache.slot_of(1, 4) is not None and cache.slot_of(2, 5) is not None


def test_a_held_guess_is_dropped_once_its_layer_is_known(copies):
    cache = ExpertCache(make_store(layers=4, experts=8), 6, "cpu", prefetch_window=1)
    cache.prefetch(1, [2, 3], keep_layer=0)
    cache.prefetch(2, [6], keep_layer=0)
    assert cache.held == [(1, 3), (2, 6)]
    slots = cache.ensure(1, [2, 3])  # 2 prefetched: a hit; 3 was only guessed: a demand miss
    assert (cache.hits, cache.misses, cache.prefetch_hits) == (1, 1, 1)
    assert cache.slot_of(1, 3) == slots[1]
    assert cache.held == [(2, 6)]  # layer 1's guesses are gone; the window is still full
    copies.finish()
    cache.ensure(2, [1])  # a stop feeds no guess before its compute is launched
    assert cache.held == [] and cache.slot_of(2, 6) is None  # layer 2 is known: 6 was dropped
    cache.prefetch(3, [4, 5], keep_layer=2)  # the prefetch after the launch feeds the window
    assert cache.held == [(3, 5)] and cache.prefetched == 2


def test_a_nearer_guess_replaces_the_held_one_of_its_layer(copies):
    cache = ExpertCache(make_store(layers=4, experts=8), 6, "cpu", prefetch_window=1)
    cache.replace_held = True
    cache.prefetch(1, [2], keep_layer=0)
    cache.prefetch(3, [5, 6], keep_layer=0)  # guessed at layer 0
    assert cache.held == [(3, 5), (3, 6)]
    cache.prefetch(3, [6, 7], keep_layer=1)  # guessed at layer 1, nearer: it replaces them
    assert cache.held == [(3, 6), (3, 7)]


def test_no_window_starts_every_guess_at_once(copies):
    cache = ExpertCache(make_store(layers=3, experts=8), 6, "cpu", prefetch_window=0)
    cache.prefetch(1, [2, 3, 4], keep_layer=0)
    cache.prefetch(2, [5], keep_layer=0)
    assert cache.prefetched == 4 and cache.held == []


def test_a_held_guess_never_evicts_the_layer_being_computed(copies):
    cache = ExpertCache(make_store(layers=3, experts=8), 2, "cpu", prefetch_window=1)
    cache.ensure(0, [0, 1])
    cache.prefetch(1, [4], keep_layer=0)  # no slot to take but layer 0's: nothing copied
    assert cache.prefetched == 0 and cache.held == []
    assert cache.cached() == [(0, 0), (0, 1)]


def _weights(store, expert):
    bank = store.banks[0]
    return bank["w13"][expert], bank["w2"][expert]


@pytest.mark.gpu
def test_prefetches_and_misses_on_two_streams_leave_each_slot_its_expert():
    """A miss's copy (its own stream) may take a slot that a prefetch (another stream) is
    still writing, and compute may read a prefetched slot: the events order all of it."""
    store = make_store(layers=3, experts=6, hidden=1024, inter=1024)  # 8 MiB a copy: slow
    cache = ExpertCache(store, num_slots=4, device="cuda")
    cache.ensure(0, [0])
    cache.prefetch(1, [0, 1, 2], keep_layer=0)  # in flight on the prefetch stream
    cache.prefetch(2, [0, 1], keep_layer=5)  # evicts (0, 0) and the prefetched (1, 0)
    slots = cache.ensure(1, [3, 4, 1])  # 1 a prefetch hit; 3, 4 evict (1, 2) and (2, 0),
    assert cache.prefetch_hits == 1  # whose prefetch copies may still be running
    reads = {e: cache.bank["w13"][s].clone() for e, s in zip([3, 4, 1], slots, strict=True)}
    torch.cuda.synchronize()
    for expert, w13 in reads.items():
        assert cache.slot_of(1, expert) is not None
        torch.testing.assert_close(w13.cpu(), store.banks[1]["w13"][expert])
    for layer, expert in cache.cached():
        slot = cache.slot_of(layer, expert)
        torch.testing.assert_close(cache.bank["w2"][slot].cpu(), store.banks[layer]["w2"][expert])


@pytest.mark.gpu
def test_a_windowed_prefetch_leaves_each_slot_its_expert():
    """Held guesses are queued one at a time behind real copies; a layer's held guesses become
    demand misses on the other stream: every slot still ends up holding its expert."""
    store = make_store(layers=3, experts=6, hidden=1024, inter=1024)  # 8 MiB a copy: slow
    cache = ExpertCache(store, num_slots=4, device="cuda", prefetch_window=1)
    cache.ensure(0, [0])
    cache.prefetch(1, [0, 1, 2], keep_layer=0)
    assert cache.prefetched == 1 and cache.held == [(1, 1), (1, 2)]
    cache.prefetch(2, [0, 1], keep_layer=0)  # fed only once (1, 0)'s copy has ended
    slots = cache.ensure(1, [0, 2, 3])  # (1, 0) prefetched; 2 was held: now a demand miss
    assert cache.prefetch_hits == 1 and all(key[0] != 1 for key in cache.held)
    reads = {e: cache.bank["w13"][s].clone() for e, s in zip([0, 2, 3], slots, strict=True)}
    torch.cuda.synchronize()
    for expert, w13 in reads.items():
        torch.testing.assert_close(w13.cpu(), store.banks[1]["w13"][expert])
    for layer, expert in cache.cached():
        slot = cache.slot_of(layer, expert)
        torch.testing.assert_close(cache.bank["w2"][slot].cpu(), store.banks[layer]["w2"][expert])


@pytest.mark.gpu
def test_the_device_reads_the_slot_table_in_place():
    """No copy of the table is sent at a stop: a graph captured once reads each row as the host
    last wrote it (what decode's replayed expert compute relies on)."""
    cache = ExpertCache(make_store(layers=2, experts=6), num_slots=2, device="cuda")
    assert cache.slot_table.is_cuda and cache.slot_table.data_ptr() == cache._table.data_ptr()
    ids = torch.tensor([0, 1, 2], device="cuda")
    out = torch.empty(3, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    row = cache.slot_table[1]
    out.copy_(row[ids])  # warm up outside the capture
    with torch.cuda.graph(graph):
        out.copy_(row[ids])
    for experts in ([0, 2], [1]):  # the second evicts (1, 0): -1 in the row
        slots = cache.ensure(1, experts)
        graph.replay()
        expected = [cache.slot_of(1, e) for e in (0, 1, 2)]
        assert out.tolist() == [-1 if s is None else s for s in expected]
        assert all(cache.slot_of(1, e) == s for e, s in zip(experts, slots, strict=True))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4"])
def test_an_expert_s_parts_lie_side_by_side_and_cross_in_one_copy(monkeypatch, fmt):
    """Each expert's parts are contiguous views into one aligned block of the layer, and a slot
    is laid out alike, so loading an expert copies its block once; a store without blocks is
    copied part by part, to the same slot contents."""
    from ft.engine.experts.store import ALIGN

    store = HostExpertStore.allocate(1, [0], 4, 256, 128, torch.bfloat16, fmt)
    block, bank = store.blocks[0], store.banks[0]
    assert block.shape[1] % ALIGN == 0 and block.shape[1] >= store.expert_bytes
    gen = torch.Generator().manual_seed(1)
    block.copy_(torch.randint(0, 256, block.shape, generator=gen, dtype=torch.uint8))
    for part in bank.values():
        row = part[2]
        assert row.is_contiguous()
        start = row.data_ptr() - block[2].data_ptr()
        assert 0 <= start and start % ALIGN == 0 and start + row.nbytes <= block.shape[1]
    copied, sources, real_copy = [], [], torch.Tensor.copy_

    def counted_copy(dst, src, **kw):
        sources.append(src)
        return real_copy(dst, src, **kw)

    for mode in ("whole", "parts"):
        if mode == "parts":  # a store made some other way than in blocks
            monkeypatch.setattr(store, "blocks", None)
        cache = ExpertCache(store, num_slots=2, device="cpu")
        sources.clear()
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        (slot,) = cache.ensure(0, [2])
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        assert len(sources) == (1 if mode == "whole" else len(bank))
        copied.append({name: part[slot].clone() for name, part in cache.bank.items()})
    for name, part in bank.items():
        for got in copied:
            assert torch.equal(got[name].view(torch.uint8), part[2].view(torch.uint8)), name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_views_of_a_copy_of_the_blocks_are_the_bank(fmt):
    """Resident moves a layer's blocks in one copy and reads its parts through block_views: over
    a copy of the blocks they are the bank's parts, byte for byte, each in its own dtype."""
    store = HostExpertStore.allocate(2, [1], 4, 256, 128, torch.bfloat16, fmt)  # 0: dense
    assert store.blocks[0] is None and store.banks[0] is None
    blocks, bank = store.blocks[1], store.banks[1]
    gen = torch.Generator().manual_seed(2)
    blocks.copy_(torch.randint(0, 256, blocks.shape, generator=gen, dtype=torch.uint8))
    copy = blocks.clone()
    views = block_views(copy, store.parts)
    assert list(views) == list(bank)
    for name, part in bank.items():
        got = views[name]
        assert (got.shape, got.dtype, got.stride()) == (part.shape, part.dtype, part.stride())
        assert got.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()  # a view
        for e in range(store.num_experts):  # as bytes: random bits may be NaNs
            assert torch.equal(got[e].view(torch.uint8), part[e].view(torch.uint8)), (name, e)
    # the CPU "device" reads the host store in place, no copy
    assert ResidentStrategy(store, "cpu").banks[1] is bank
