"""Decode on device gates (offload's default): each layer waits on the device for the host to
fetch its misses, a copy past its bound read in place from the host store, and the cache the
host keeps warm as it follows the step (ft.engine.experts.gated, ft.engine.strategies.gated,
graphs.follow_step / StopRows). On the CPU the "device" reads the same memory, so these check
the logic; tests marked gpu check it on CUDA."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from ft.engine.config import EngineConfig
from ft.engine.experts import gated as gated_cache
from ft.engine.experts import stream_write
from ft.engine.experts.gated import GatedCache
from ft.engine.experts.grouped import InPlace, moe_pairs, plan_blocks, reduce_pairs
from ft.engine.experts.store import expert_blocks
from ft.engine.experts.stream_write import stream_writer
from ft.engine.graphs import Handoff, StopRows, cut_layers, follow_step, run_stretch
from ft.engine.model.decoder import route
from ft.engine.model.fused import rms_norm
from ft.engine.runner import LLMEngine, SamplingParams
from ft.errors import FtError
from tests.engine.interpreter import run_interpreted
from tests.engine.test_expert_cache import copies, make_store  # noqa: F401  (a fixture)
from tests.engine.test_runner import PROMPTS, run_all


def engine(model_dir, device="cpu", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", **kw))


def test_gated_offload_decodes_like_resident_and_counts_what_it_read_in_place(synth_tiny):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    resident = run_all(engine(synth_tiny[0]), PROMPTS, params)
    gated = engine(synth_tiny[0], moe_strategy="offload", moe_cache_size=6)  # gates: the default
    assert type(gated.strategy).__name__ == "GatedOffloadStrategy"
    assert run_all(gated, PROMPTS, params) == resident  # batch 4, a cache of 6 slots
    one = run_all(gated, PROMPTS[:1], params)  # batch 1 on the warm cache
    assert one == {0: resident[0]}
    c = gated.strategy.counters()
    assert c["cache_hits"] + c["cache_misses"] == c["expert_uses"]
    assert c["cache_misses"] > 0 and c["cache_hits"] > 0
    # copied and waited for; in place only where the layer's experts outnumber the slots
    assert 0 < c["cache_misses"] - c["experts_in_place"] <= c["experts_fetched"]
    expert_bytes = gated.strategy.store.expert_bytes
    assert c["bytes_fetched"] == (c["experts_fetched"] + c["experts_in_place"]) * expert_bytes


def test_gates_are_offload_s_and_hybrid_s():
    with pytest.raises(FtError, match="--moe-gates is offload's and hybrid's"):
        EngineConfig(model="m", device="cpu", moe_strategy="resident", moe_gates=True)


@pytest.mark.parametrize(
    "settings, gates",
    [
        (dict(moe_strategy="offload"), True),  # offload's default
        (dict(moe_strategy="offload", moe_gates=False), False),  # host stops
        (dict(moe_strategy="hybrid"), False),  # on the CPU: its host stops by default
        (dict(moe_strategy="hybrid", moe_gates=True), True),  # its CPU experts at the gate
        (dict(moe_strategy="resident"), False),
    ],
)
def test_gates_are_offload_s_and_hybrid_s_default_unless_turned_off(settings, gates):
    assert EngineConfig(model="m", device="cpu", **settings).gates is gates


@pytest.mark.parametrize("moe_gates, gates", [(None, True), (False, False)])
def test_hybrid_decodes_on_gates_by_default_on_cuda(monkeypatch, moe_gates, gates):
    import ft.engine.config as config

    monkeypatch.setattr(config, "_resolve_device", lambda device: device)  # no GPU needed
    hybrid = EngineConfig(model="m", device="cuda", moe_strategy="hybrid", moe_gates=moe_gates)
    assert hybrid.gates is gates
    assert hybrid.prefetch_depths == ((3, 2) if gates else (2, 2))


def test_a_slot_not_ready_is_read_in_place_and_counted_once():
    n, gen = 3, torch.Generator().manual_seed(0)
    store = make_store(layers=2, experts=6)
    bank, layer, experts = store.banks[1], 1, 6
    slots = {k: torch.randn((n, *v.shape[1:]), generator=gen) for k, v in bank.items()}
    for slot, expert in enumerate([4, 0, 2]):  # experts 4, 0, 2 have slots; 1, 3, 5 have none
        for k in slots:
            slots[k][slot] = bank[k][expert]
    table = torch.tensor([1, -1, 2, -1, 0, -1], dtype=torch.int32)
    ready = torch.tensor([4, 0, 99], dtype=torch.int32) + layer * experts  # slot 2: not landed
    ids = torch.tensor([[1, 4], [3, 1], [0, 2]])  # expert 1 routed twice: one miss
    weights = torch.rand(3, 2, generator=gen)
    misses = torch.zeros(1, dtype=torch.long)
    in_place = InPlace(n, misses, ready, layer * experts)
    blocks = plan_blocks(ids, weights, table, "torch", in_place)
    expected_slots = [n + 1, 0, n + 3, n + 1, 1, n + 2]  # expert 2's slot is not ready
    assert sorted(blocks.slot.tolist()) == sorted(expected_slots)
    assert int(misses) == 3  # experts 1, 3 and 2
    x = torch.randn(3, 8, generator=gen)
    got = reduce_pairs(blocks, moe_pairs(x, slots, blocks, "torch", "bf16", host=bank), 3)
    whole = plan_blocks(ids, weights, None, "torch")  # slot = expert: all from the store
    expected = reduce_pairs(whole, moe_pairs(x, bank, whole, "torch", "bf16"), 3)
    torch.testing.assert_close(got, expected)


_GATED = """
import threading, time
import torch
from ft.engine.experts.grouped import InPlace, plan_blocks

table = torch.tensor([0, -1, -1, -1], dtype=torch.int32)  # expert 0 in slot 0; 1 and 3: none yet
ready = torch.tensor([0, -1, -1], dtype=torch.int32)  # layer 0: a slot's mark is its expert
gate, kept = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
weights, misses = torch.rand(2, 2), torch.zeros(1, dtype=torch.long)

def host():  # opens the layer late: expert 1 copied into slot 2 (landed), no slot for 3
    time.sleep(0.3)
    table[1], ready[2], gate[0] = 2, 1, 1

def plan(ids):
    follower = threading.Thread(target=host)
    start = time.monotonic()
    follower.start()
    in_place = InPlace(3, misses, ready, 0, False, gate, kept)
    blocks = plan_blocks(ids, weights, table, "triton", in_place)
    waited = time.monotonic() - start
    follower.join()
    return blocks, waited

blocks, waited = plan(torch.tensor([[0, 1], [3, 0]]))
assert sorted(blocks.slot.tolist()) == [0, 0, 2, 3 + 3], blocks.slot  # 3 read in place
assert int(misses) == 1 and waited >= 0.3
gate[0], table[1], ready[2] = 0, -1, -1
blocks, waited = plan(torch.tensor([[0, 0], [0, 0]]))  # nothing missing: it waits all the same
assert blocks.slot.tolist() == [0] * 4 and waited >= 0.3 and int(misses) == 1
gate[0], table[1], ready[2], kept[0] = 0, -1, -1, 1  # the host keeps the layer's slots
blocks, waited = plan(torch.tensor([[0, 0], [0, 0]]))  # every expert named: no wait
assert blocks.slot.tolist() == [0] * 4 and waited < 0.3 and int(misses) == 1
gate[0], table[1], ready[2] = 0, -1, -1
blocks, waited = plan(torch.tensor([[0, 1], [0, 0]]))  # expert 1 has no slot: the gate
assert sorted(blocks.slot.tolist()) == [0, 0, 0, 2] and waited >= 0.3 and int(misses) == 1
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(120)
def test_a_gated_plan_waits_for_the_host_then_reads_the_table():
    """A layer's work list waits at its gate until the host opens it (the interpreter's kernel
    polls the tensors a thread writes), then reads the table: the expert copied meanwhile comes
    from its slot, the one the host found no slot for is read in place. A kept layer whose
    experts the table names goes on without the gate; one with an expert unnamed waits."""
    proc = run_interpreted(_GATED, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


_CPU_SHARE = """
import torch
from ft.engine.experts.grouped import CPU_SHARE, ON_CPU, CpuShare, InPlace, moe_pairs, plan_blocks
from ft.engine.experts.grouped import reduce_pairs

gen = torch.Generator().manual_seed(0)
bank = {"w13": torch.randn(4, 16, 8, generator=gen), "w2": torch.randn(4, 8, 8, generator=gen)}
slots = {k: v[:2].clone() for k, v in bank.items()}  # slot s holds expert s (0, 1)
table = torch.tensor([0, 1, ON_CPU, -1], dtype=torch.int32)  # 2: the CPU's; 3: no slot
ready = torch.tensor([0, 1], dtype=torch.int32)
ids, weights = torch.tensor([[0, 2], [3, 1]]), torch.rand(2, 2, generator=gen)
x = torch.randn(2, 8, generator=gen)
whole = plan_blocks(ids, weights, None, "torch")  # every expert from the store: the reference
ref = reduce_pairs(whole, moe_pairs(x, bank, whole, "torch", "bf16"), 2)
cpu_only = plan_blocks(ids[:1, 1:], weights[:1, 1:], None, "torch")  # expert 2 for token 0
cpu = reduce_pairs(cpu_only, moe_pairs(x[:1], bank, cpu_only, "torch", "bf16"), 1)

def run(gate_value, backend):
    misses = torch.zeros(1, dtype=torch.long)
    gate, kept = torch.tensor([gate_value], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    rows = torch.zeros(4, 8)
    rows[:1] = cpu if gate_value == CPU_SHARE else 99.0  # unread unless the gate says so
    share = CpuShare(rows, torch.zeros(1, dtype=torch.int32))
    in_place = InPlace(2, misses, ready, 0, False, gate, kept, share)
    blocks = plan_blocks(ids, weights, table, backend, in_place)
    y = moe_pairs(x, slots, blocks, "torch", "bf16", host=bank)
    return reduce_pairs(blocks, y, 2, torch.float32, backend, share), int(misses), share

for backend in ("triton", "torch"):
    got, misses, share = run(CPU_SHARE, backend)  # the CPU's sum written: expert 2 skipped
    assert int(share.shared[0]) == 1 and misses == 1, (backend, misses)  # 3 read in place
    torch.testing.assert_close(got, ref)
    got, misses, share = run(1, backend)  # opened without it: expert 2 read in place
    assert int(share.shared[0]) == 0 and misses == 2, (backend, misses)
    torch.testing.assert_close(got, ref)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(120)
def test_an_expert_marked_for_the_cpu_is_skipped_only_where_its_share_is_written():
    """Hybrid on gates: the plan (Triton under the interpreter, and torch) skips an expert the
    table marks ON_CPU where the gate opened with CPU_SHARE, and the sum adds the CPU's row;
    opened otherwise (a stalled host's gate times out as 0) the expert is read in place. Both
    give the exact layer."""
    proc = run_interpreted(_CPU_SHARE, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_gates_copy_a_layer_s_misses_first_then_open_it(copies):  # noqa: F811
    cache = GatedCache(make_store(layers=4, experts=8), 6, "cpu", 1)
    assert int(cache.opened[0]) == 0
    cache.follow(0, [1, 2], [(1, [3]), (2, [4])])
    assert cache.cached()[:2] == [(0, 1), (0, 2)]  # the misses before any guess, window or not
    assert int(cache.opened[0]) == 1 and cache.misses == 2 and cache.prefetched == 1
    assert cache.held == [(2, 4)] and not cache._later
    for expert in (1, 2):  # named in the table, marked ready behind their data
        slot = cache.slot_of(0, expert)
        assert int(cache.slot_table[0, expert]) == slot
        assert int(cache.ready[slot]) == cache.code(0, expert)
    copies.finish()
    cache.follow(1, [3, 5], [])
    assert cache.misses == 3 and cache.prefetch_hits == 1 and int(cache.opened[1]) == 1
    cache.begin_step()  # the next step: every gate shut
    assert int(cache.opened.sum()) == 0


def test_gates_without_kept_layers_take_the_slot_of_any_layer_but_the_one_they_open(
    copies, monkeypatch,  # noqa: F811
):  # fmt: skip
    monkeypatch.setattr(gated_cache, "KEEP_AHEAD", 0)  # every layer waits for its gate
    cache = GatedCache(make_store(layers=3, experts=8), 2, "cpu")
    cache.ensure(2, [0, 1])  # both slots: a layer the GPU has not reached; its gate is shut
    cache.follow(0, [1, 2], [])
    assert cache.cached() == [(0, 1), (0, 2)] and int(cache.slot_table[2, 0]) == -1
    cache.follow(0, [1, 2, 3], [])  # more experts than slots: the third has none to take
    assert cache.cached() == [(0, 1), (0, 2)] and int(cache.slot_table[0, 3]) == -1
    assert cache.misses == 2 + 2 + 1 and int(cache.opened[0]) == 1  # opened all the same


def test_gates_keep_the_layers_after_the_one_they_follow_and_take_no_slot_of_theirs(
    copies, monkeypatch,  # noqa: F811
):  # fmt: skip
    monkeypatch.setattr(gated_cache, "KEEP_AHEAD", 2)
    cache = GatedCache(make_store(layers=8, experts=8), 3, "cpu")
    assert cache.keep_ahead == 2  # at most a quarter of the layers
    for layer in (1, 2, 5):  # least recently used first: (1, 0), (2, 0), (5, 0)
        cache.ensure(layer, [0])
    cache.begin_step()  # the step's first two layers kept before the GPU starts it
    assert cache.kept.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    cache.follow(0, [1], [])  # kept: layers 1 and 2, whatever their age; 5 is taken
    assert cache.kept.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert cache.cached() == [(1, 0), (2, 0), (0, 1)] and int(cache.slot_table[5, 0]) == -1
    cache.follow(3, [2], [])  # layers 0-2 are done: the least recent of them goes
    assert cache.cached() == [(2, 0), (0, 1), (3, 2)] and int(cache.slot_table[1, 0]) == -1
    assert cache.kept.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    cache.follow(4, [6, 7], [])  # the two least recent of the layers done go
    assert cache.cached() == [(3, 2), (4, 6), (4, 7)] and cache.misses == 3 + 1 + 1 + 2
    cache.begin_step()
    assert cache.kept.tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and int(cache.opened.sum()) == 0


def test_a_copy_marks_its_slot_ready_with_the_expert_s_code():
    cache = GatedCache(make_store(layers=3, experts=8), 4, "cpu")
    cache.follow(0, [1], [(1, [2, 3])])  # the guesses of layer 1, then layer 0's miss
    for layer, expert in [(1, 2), (1, 3), (0, 1)]:
        assert int(cache.ready[cache.slot_of(layer, expert)]) == cache.code(layer, expert)
    assert cache.code(2, 5) == 2 * 8 + 5


def test_a_top_up_queues_held_guesses_between_routings_as_copies_end(copies):  # noqa: F811
    cache = GatedCache(make_store(layers=4, experts=8), 6, "cpu", 1)
    cache.follow(1, [0], [(2, [1, 2]), (3, [3])])
    assert cache.cached()[-1] == (2, 1) and cache.held == [(2, 2), (3, 3)]
    cache.top_up()  # the copy in flight has not ended: the window is full
    assert cache.held == [(2, 2), (3, 3)]
    copies.finish()
    cache.top_up()  # it has: the next guess goes, as follow would queue it
    assert cache.held == [(3, 3)] and cache.cached()[-1] == (2, 2)
    assert cache.cached()[0] == (1, 0)  # the layer the GPU may be reading kept its slot


class LazyDevice:
    """Plays the GPU for follow_step on the CPU: stretch k runs only when the host first waits
    for cut k's rows, so the host sees the GPU ahead of it only where the test says."""

    def __init__(self, model, cuts, buffers, inputs, rows: StopRows, ahead: int = 0):
        self.model, self.cuts, self.buffers, self.inputs = model, cuts, buffers, inputs
        self.rows, self.ran, self.ahead, self.out = rows, -1, ahead, None
        self.width = rows.width

    def run_to(self, k):
        while self.ran < min(k, len(self.cuts)):
            j = self.ran + 1
            rows = self.rows.device  # a row past the cuts: the next token's guesses
            stop = rows[j, : self.inputs[0].shape[0]] if j < rows.shape[0] else None
            src, dst = self.buffers[j % 2], self.buffers[(j + 1) % 2]
            self.out = run_stretch(self.model, self.cuts, j, src, dst, self.inputs, stop)
            self.ran = j

    def launch(self):
        self.run_to(self.ahead)
        return self

    def wait(self, k, b, width, idle=None):
        self.run_to(k + self.ahead)
        return self.rows.wait(k, b, width, idle)

    def ready(self, k, b):
        return self.rows.ready(k, b)


def test_a_followed_step_equals_the_model_forward_and_follows_every_cut(synth_tiny):
    from tests.engine.test_graphs import decode_batch

    gated = engine(synth_tiny[0], moe_strategy="offload", moe_cache_size=6)
    model, strategy = gated.model, gated.strategy
    batch = decode_batch(gated)
    cuts = cut_layers(model, strategy)
    assert cuts == gated.model_config.moe_layers and strategy.depth_at(3) == 2
    followed = []
    real_follow = strategy.follow
    strategy.follow = lambda *a: followed.append(a) or real_follow(*a)
    results = []
    # the GPU level with the host; one cut ahead of it (a kept layer passes its gate)
    for ahead in (0, 1):
        width = (1 + strategy.prefetch_depth) * model.cfg.top_k
        rows = StopRows(len(cuts) + 1, 4, width, "cpu")  # one row more: the next token's
        depth = strategy.prefetch_depth  # the deepest any batch size takes (gates: 3 at b1)
        buffers = [Handoff.allocate(4, model.cfg, model.embed.dtype, "cpu", depth) for _ in "ab"]
        inputs = (batch.token_ids, batch.positions, batch.slots, 64)
        device = LazyDevice(model, cuts, buffers, inputs, rows, ahead)
        followed.clear()
        out = follow_step(strategy, cuts, device, 3, device.launch)
        device.run_to(len(cuts))  # the rest of the step
        results.append(device.out)
        assert [f[0] for f in followed] == cuts  # every cut, in order
        guessed = [[later for later, _ in f[2]] for f in followed]
        if ahead == 0:  # guesses of the next two cuts, nearest first
            assert guessed == [cuts[k + 1 : k + 3] for k in range(len(cuts))]
        else:  # the next cut is routed already: its guess would come too late
            assert guessed == [cuts[k + 2 : k + 3] for k in range(len(cuts))]
        assert out is device and (rows.host < 0).all()  # every row read and reset
    expected = model.forward(batch)
    for logits in results:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_the_step_s_end_guesses_the_next_token_s_first_cuts_for_the_host(synth_tiny):
    from tests.engine.test_graphs import decode_batch

    gated = engine(synth_tiny[0], moe_strategy="offload", moe_cache_size=6, moe_gates=True)
    model, strategy, cfg = gated.model, gated.strategy, gated.model.cfg
    assert strategy.host_follows  # a step the host follows guesses the next token
    batch = decode_batch(gated)
    cuts = cut_layers(model, strategy)
    handed = []
    real_guess = strategy.guess_next_token
    strategy.guess_next_token = lambda g: handed.append(g) or real_guess(g)
    width = (1 + strategy.prefetch_depth) * cfg.top_k
    rows = StopRows(len(cuts) + 1, 4, width, "cpu")  # one row more: the next token's
    buffers = [
        Handoff.allocate(4, cfg, model.embed.dtype, "cpu", strategy.prefetch_depth) for _ in "ab"
    ]
    inputs = (batch.token_ids, batch.positions, batch.slots, 64)
    device = LazyDevice(model, cuts, buffers, inputs, rows)
    prefetched = strategy.cache.prefetched
    follow_step(strategy, cuts, device, 3, device.launch)
    expected = model.forward(batch)
    torch.testing.assert_close(device.out, expected, rtol=1e-5, atol=1e-5)  # logits unchanged
    # what the host was handed: each first cut's router on the argmax token's normed embedding
    x = F.embedding(expected.argmax(dim=-1), model.embed)
    x = rms_norm(x, model.layers[cuts[0]].w["ln2"], cfg.rms_norm_eps)
    ahead = cuts[: 1 + strategy.depth_at(3)]
    assert [cut for cut, _ in handed[0]] == ahead and len(handed) == 1
    for j, (cut, ids) in enumerate(handed[0]):
        want, _ = route(cfg, model.routers_of(j, 1), x)
        assert ids == want.tolist(), cut
    assert strategy.cache.prefetched > prefetched  # copies queued for them, within the window
    assert (rows.host < 0).all()  # the extra row read and reset too


@pytest.fixture(scope="module")
def synth_six(tmp_path_factory):
    """The tiny preset with six layers: room for guesses three cuts ahead."""
    from ft.engine.synth.checkpoint import synth_checkpoint

    out = tmp_path_factory.mktemp("synth6") / "tiny6"
    synth_checkpoint("tiny", out, layers=6, dtype="float32", seed=1)
    return out


@pytest.mark.parametrize("b", [1, 3])
def test_device_gates_guess_three_cuts_ahead_at_batch_1_and_two_above(synth_six, b):
    """--moe-prefetch-depth auto (docs/performance.md): the step's stretches route the
    next 3 cuts at batch 1, 2 above, and the step's end the next token's first 1 + depth."""
    gated = engine(synth_six, moe_strategy="offload", moe_cache_size=24, moe_gates=True)
    model, strategy = gated.model, gated.strategy
    for prompt in PROMPTS[:b]:
        gated.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    gated.step()  # prefill
    batch = gated._batch(gated.scheduler.schedule()[0], is_prefill=False)
    cuts, depth = cut_layers(model, strategy), strategy.depth_at(b)
    assert len(cuts) == 6 and strategy.prefetch_depths == (3, 2) and depth == (3 if b == 1 else 2)
    followed, handed = [], []
    real_follow, real_guess = strategy.follow, strategy.guess_next_token
    strategy.follow = lambda *a: followed.append(a) or real_follow(*a)
    strategy.guess_next_token = lambda g: handed.append(g) or real_guess(g)
    width = (1 + strategy.prefetch_depth) * model.cfg.top_k  # room for the deepest
    rows = StopRows(len(cuts) + 1, 4, width, "cpu")
    dtype = model.embed.dtype
    buffers = [Handoff.allocate(4, model.cfg, dtype, "cpu", strategy.prefetch_depth) for _ in "ab"]
    device = LazyDevice(
        model, cuts, buffers, (batch.token_ids, batch.positions, batch.slots, 64), rows
    )
    follow_step(strategy, cuts, device, b, device.launch)
    guessed = [[later for later, _ in f[2]] for f in followed]
    assert guessed == [cuts[k + 1 : k + 1 + depth] for k in range(len(cuts))]
    assert [cut for cut, _ in handed[0]] == cuts[: 1 + depth]
    torch.testing.assert_close(device.out, model.forward(batch), rtol=1e-5, atol=1e-5)
    assert (rows.host < 0).all()


def test_stop_rows_are_waited_for_read_once_and_time_out(monkeypatch):
    rows = StopRows(2, 2, 3, "cpu")
    assert not rows.ready(0, 1)

    def device():
        time.sleep(0.05)
        rows.device[0, :2] = torch.tensor([[1, 2, 3], [4, 5, 6]])

    writer = threading.Thread(target=device)
    writer.start()
    polls = []
    assert rows.wait(0, 2, 3, idle=lambda: polls.append(1)) == [[1, 2, 3], [4, 5, 6]]
    writer.join()
    assert len(polls) > 1  # the host's own work while it waits, at each poll
    assert not rows.ready(0, 2)  # reset for the next step
    monkeypatch.setattr(StopRows, "TIMEOUT_S", 0.05)
    with pytest.raises(FtError, match="routing of MoE cut 1 did not arrive"):
        rows.wait(1, 1, 3)


@pytest.mark.gpu
def test_the_kernels_read_a_miss_in_place_on_cuda():
    store = make_store(layers=1, experts=6, hidden=256, inter=128)  # pinned: CUDA is present
    bank = store.banks[0]
    _, slots = expert_blocks(3, store.parts, device="cuda")  # laid out as the store, as the cache
    for slot, expert in enumerate([4, 0, 2]):
        for k in slots:
            slots[k][slot] = bank[k][expert].cuda()
    table = torch.tensor([1, -1, 2, -1, 0, -1], dtype=torch.int32, device="cuda")
    ready = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")  # layer 0: code = expert
    ids = torch.tensor([[1, 4], [3, 1], [0, 5]], device="cuda")
    weights = torch.rand(3, 2, device="cuda")
    x = torch.randn(3, 256, device="cuda")
    counter = torch.zeros(1, dtype=torch.long, device="cuda")
    blocks = plan_blocks(ids, weights, table, "triton", InPlace(3, counter, ready, 0))
    got = reduce_pairs(blocks, moe_pairs(x, slots, blocks, "triton", "bf16", host=bank), 3)
    resident = {k: v.cuda() for k, v in bank.items()}
    whole = plan_blocks(ids, weights, None, "triton")
    expected = reduce_pairs(whole, moe_pairs(x, resident, whole, "triton", "bf16"), 3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert int(counter) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", ["gates", "gates_copied_marks"])
def test_gates_decode_like_resident_on_cuda(synth_tiny, monkeypatch, graphs, mode):
    from tests.engine.test_graphs import generate

    resident, _ = generate(synth_tiny[0], monkeypatch, graphs=False)
    if mode == "gates_copied_marks":  # the ready marks copied, as where the driver can't write
        monkeypatch.setattr(stream_write, "_driver_writer", lambda device_index: None)
        mode = "gates"
    config = dict(moe_strategy="offload", moe_cache_size=14, **{f"moe_{mode}": True})  # evicts
    got, stats = generate(synth_tiny[0], monkeypatch, graphs=graphs, **config)
    assert got == resident
    assert stats.cache_hits + stats.cache_misses == stats.expert_uses
    assert stats.cache_misses > 0 and stats.experts_fetched > 0


@pytest.mark.gpu
@pytest.mark.parametrize("marking", ["copied", "written"])
def test_the_plan_waits_for_a_queued_copy_and_reads_in_place_past_its_bound(marking):
    """A slot whose ready mark lands while the work-list kernel polls is used; one whose mark
    never lands is read in place once the kernel stops polling. The mark queued behind the
    copy as the cache does it: a 4-byte copy, or written from the stream (stream_write)."""
    table = torch.tensor([0, 1, -1, -1], dtype=torch.int32, device="cuda")
    ready = torch.tensor([-1, -1], dtype=torch.int32, device="cuda")  # neither landed yet
    ids, weights = torch.tensor([[0, 1]], device="cuda"), torch.rand(1, 2, device="cuda")
    misses = torch.zeros(1, dtype=torch.long, device="cuda")
    big = torch.empty(32 << 20, dtype=torch.uint8).pin_memory()  # ~0.6 ms of copy ahead
    side, mark = torch.cuda.Stream(), torch.tensor([0], dtype=torch.int32).pin_memory()
    scratch = torch.empty_like(big, device="cuda")
    write = stream_writer(0) if marking == "written" else None
    if marking == "written" and write is None:
        pytest.skip("this driver has no stream memory operations")
    with torch.cuda.stream(side):  # slot 0's mark lands behind a long copy; slot 1's never
        scratch.copy_(big, non_blocking=True)
        if write is None:
            ready[:1].copy_(mark, non_blocking=True)
        else:
            write(side.cuda_stream, ready.data_ptr(), 0)
    blocks = plan_blocks(ids, weights, table, "triton", InPlace(4, misses, ready, 0))
    torch.cuda.synchronize()
    assert sorted(blocks.slot.tolist()) == [0, 4 + 1]  # waited for slot 0; expert 1 in place
    assert int(misses) == 1


@pytest.mark.gpu
def test_a_gated_plan_waits_for_the_host_on_cuda_and_not_past_its_bound():
    """The host opens the layer 5 ms after the plan is queued: the plan waits for it, then for
    the copy's mark, and takes the slot; a gate never opened lets it go (in place)."""
    from ft.engine.experts.cache import device_view

    host_table = torch.tensor([0, -1, -1], dtype=torch.int32).pin_memory()
    host_gate = torch.zeros(1, dtype=torch.int32).pin_memory()
    table, gate = (device_view(t, torch.device("cuda")) for t in (host_table, host_gate))
    ready = torch.tensor([0, -1, -1], dtype=torch.int32, device="cuda")
    ids, weights = torch.tensor([[0, 1]], device="cuda"), torch.rand(1, 2, device="cuda")
    misses = torch.zeros(1, dtype=torch.long, device="cuda")
    blocks = plan_blocks(ids, weights, table, "triton", InPlace(3, misses, ready, 0, True, gate))
    time.sleep(0.005)  # the plan polls the gate meanwhile
    side, mark = torch.cuda.Stream(), torch.tensor([1], dtype=torch.int32).pin_memory()
    with torch.cuda.stream(side):  # the host's copy of expert 1 into slot 2, its mark behind
        ready[2:3].copy_(mark, non_blocking=True)
    host_table[1] = 2
    host_gate[0] = 1
    torch.cuda.synchronize()
    assert sorted(blocks.slot.tolist()) == [0, 2] and int(misses) == 0
    host_gate[0], host_table[1] = 0, -1
    start = time.monotonic()
    blocks = plan_blocks(ids, weights, table, "triton", InPlace(3, misses, ready, 0, True, gate))
    torch.cuda.synchronize()
    assert sorted(blocks.slot.tolist()) == [0, 3 + 1] and int(misses) == 1
    assert time.monotonic() - start < 5.0  # bounded: ~16k polls of pinned memory


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [True, False])
def test_a_kept_layer_reads_its_table_at_once_where_every_expert_has_a_slot_on_cuda(kept):
    """Gate shut, every routed expert named: a kept layer reads the table at once; one not kept
    waits for the gate (to its bound) and reads it later, after the host has cleared an entry
    meanwhile (then in place)."""
    from ft.engine.experts.cache import device_view

    cuda = torch.device("cuda")
    host_table = torch.tensor([0, 1, -1], dtype=torch.int32).pin_memory()
    host_gate, host_kept = (torch.zeros(1, dtype=torch.int32).pin_memory() for _ in "gk")
    table, gate, kept_flag = (device_view(t, cuda) for t in (host_table, host_gate, host_kept))
    host_kept[0] = int(kept)
    ready = torch.tensor([0, 1, -1], dtype=torch.int32, device=cuda)
    ids, weights = torch.tensor([[0, 1]], device=cuda), torch.rand(1, 2, device=cuda)
    misses = torch.zeros(1, dtype=torch.long, device=cuda)
    in_place = InPlace(3, misses, ready, 0, True, gate, kept_flag)
    host_gate[0] = 1  # warm: the kernel compiled and loaded before the timed plan
    plan_blocks(ids, weights, table, "triton", in_place)
    torch.cuda.synchronize()
    host_gate[0], misses[0] = 0, 0
    blocks = plan_blocks(ids, weights, table, "triton", in_place)
    time.sleep(0.005)  # a plan waiting for the gate polls it meanwhile
    host_table[1] = -1  # the host takes expert 1's slot: a waiting plan reads it in place
    torch.cuda.synchronize()
    assert sorted(blocks.slot.tolist()) == ([0, 1] if kept else [0, 3 + 1])
    assert int(misses) == (0 if kept else 1)
