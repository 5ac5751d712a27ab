"""Device gates (ft.engine.gates): the host's order of work in a gated decode step; the gate and
signal kernels' protocol, under Triton's interpreter on CPU tensors; and a whole gated step on
the CPU, its stretches run by a thread that plays the GPU's stream, equal to the model's forward.
On CUDA, tests/engine/test_graphs.py decodes with gates and without and compares the tokens."""

from __future__ import annotations

import pytest
import torch

from ft.engine.graphs import Handoff, run_gated_step
from tests.engine.interpreter import run_interpreted

pytest.importorskip("triton")


class RecordingGates:
    """Stands in for StopGates on the host's side: the stretches' stop rows, read in order."""

    def __init__(self, calls):
        self.calls, self.signalled = calls, []

    def rows_of(self, batch):
        self.calls.append(("rows",))
        return self.signalled.pop(0)

    def open(self, k, stream=None):
        self.calls.append(("open", k, stream))

    def abandon(self, closed):
        self.calls.append(("abandon", list(closed)))


class RecordingStrategy:
    prefetch_depth = 1

    def __init__(self, calls, ready=None, fail_at=None):
        self.calls, self.ready, self.fail_at = calls, ready or {}, fail_at

    def prepare_gated(self, layer, topk_ids, x, topk_weights):
        if layer == self.fail_at:
            raise RuntimeError("stop failed")
        self.calls.append(("prepare", layer, topk_ids))
        return self.ready.get(layer)

    def prefetch(self, layer, topk_ids, keep_layer):
        self.calls.append(("prefetch", layer, topk_ids, keep_layer))


def gated_run(cuts, rows, strategy, calls):
    gates = RecordingGates(calls)
    gates.signalled = [rows[k] for k in range(len(cuts))]  # the step runs on the device
    outs = [Handoff(*(torch.zeros(1, 4),) * 2, ids=None, weights=None, stop=None) for _ in cuts]
    run_gated_step(strategy, cuts, outs + [torch.zeros(1, 8)], gates, batch=1)


def test_a_gated_step_serves_each_stop_in_order():
    calls, cuts = [], [1, 3, 5]
    rows = {0: [[4, 6]], 1: [[6, 9]], 2: [[9, 0]]}  # K=1: the routed id, then the next cut's guess
    copy_stream = object()
    strategy = RecordingStrategy(calls, ready={3: copy_stream})  # cut 3 waits for copies
    gated_run(cuts, rows, strategy, calls)
    assert calls == [
        ("rows",), ("prepare", 1, [[4]]), ("open", 0, None), ("prefetch", 3, [[6]], 1),
        ("rows",), ("prepare", 3, [[6]]), ("open", 1, copy_stream), ("prefetch", 5, [[9]], 3),
        ("rows",), ("prepare", 5, [[9]]), ("open", 2, None),
    ]  # fmt: skip


def test_a_failed_stop_opens_the_gates_it_left_closed():
    calls, cuts = [], [1, 3, 5]
    rows = {0: [[4, 6]], 1: [[6, 9]], 2: [[9, 0]]}
    with pytest.raises(RuntimeError, match="stop failed"):
        gated_run(cuts, rows, RecordingStrategy(calls, fail_at=3), calls)
    assert calls[-1] == ("abandon", [1, 2])  # the step's stretches 2 and 3 wait behind them


def test_the_gate_and_signal_kernels_keep_the_protocol():
    """Interpreted: a signal's rows reach the host, which clears them; a wait spins until the
    host opens the gate, then copies the cut's slot table row; openings and passes are counts,
    so two openings let two waits through."""
    result = run_interpreted(
        """
        import threading, time
        import torch
        from ft.engine.gates import StopGates

        table_host = torch.arange(12, dtype=torch.int32).reshape(3, 4)  # [layers, E]
        table_device = torch.full((3, 4), -1, dtype=torch.int32)
        gates = StopGates(2, max_batch=2, columns=3, table_host=table_host,
                          table_device=table_device)
        gates.signal(torch.tensor([[7, 8, 9], [1, 2, 3]]))
        assert gates.rows_of(2) == [[7, 8, 9], [1, 2, 3]]
        assert (gates.rows == -1).all()  # cleared for the next signal

        opener = threading.Timer(0.3, gates.open, args=(1,))
        start = time.monotonic()
        opener.start()
        gates.wait(1, layer=2)  # spins until the timer opens gate 1
        assert time.monotonic() - start >= 0.25
        assert table_device[2].tolist() == [8, 9, 10, 11] and (table_device[:2] == -1).all()
        assert gates.passed.tolist() == [0, 1]

        gates.open(0); gates.open(0)
        gates.wait(0, layer=0); gates.wait(0, layer=1)
        assert gates.passed.tolist() == [2, 1]
        assert table_device[1].tolist() == [4, 5, 6, 7]
        try:
            gates.rows_of(1, timeout=0.1)
        except Exception as exc:
            print("timeout:", exc)
        print("ok")
        """,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "timeout: decode: no routing ids from the device in 0 s" in result.stdout
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name,depth", [("offload", 2), ("hybrid", 1)])
def test_a_gated_step_equals_the_model_forward(synth_tiny, strategy_name, depth):
    """The whole protocol on the CPU: a thread runs the launched stretches in order (the GPU's
    stream), gates and signals interpreted, the host's loop as on CUDA."""
    result = run_interpreted(
        f"""
        import threading
        import torch
        from ft.engine.config import EngineConfig
        from ft.engine.gates import StopGates
        from ft.engine.graphs import Handoff, cut_layers, run_gated_step, run_stretch
        from ft.engine.runner import LLMEngine, SamplingParams

        config = EngineConfig(
            model={str(synth_tiny[0])!r}, device="cpu", max_model_len=64,
            moe_strategy={strategy_name!r}, moe_cache_size=14, moe_prefetch_depth={depth},
            moe_hybrid_max_fetch=0.3, cpu_moe_threads=1,
        )
        engine = LLMEngine(config)
        model, strategy = engine.model, engine.strategy
        for prompt in ([5, 9, 13], [40, 2, 77, 31, 8, 1, 6], [88]):
            engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()  # prefill
        seqs, _ = engine.scheduler.schedule()
        batch = engine._batch(seqs, is_prefill=False)
        cuts = cut_layers(model, strategy)
        top_k = model.cfg.top_k
        buffers = [Handoff.allocate(4, model.cfg, model.embed.dtype, "cpu", {depth})
                   for _ in range(2)]
        cache = strategy.cache
        gates = StopGates(len(cuts), 4, (1 + {depth}) * top_k, cache.host_table,
                          cache.slot_table)
        inputs = (batch.token_ids, batch.positions, batch.slots, 64)
        results = []

        def device():  # the GPU's stream: the step's stretches, in order, each at its gate
            for k in range(len(cuts) + 1):
                src, dst = buffers[k % 2], buffers[(k + 1) % 2]
                results.append(run_stretch(model, cuts, k, src, dst, inputs, gates))

        worker = threading.Thread(target=device)
        worker.start()
        outs = [buffers[(k + 1) % 2].rows(3) for k in range(len(cuts))]
        run_gated_step(strategy, cuts, outs, gates, batch=3)
        worker.join()
        out = results[-1]
        assert gates.passed.tolist() == [1] * len(cuts)
        counters = strategy.counters()
        assert counters["experts_prefetched"] > 0
        assert (counters["experts_cpu"] > 0) == ({strategy_name!r} == "hybrid")
        expected = model.forward(batch)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        engine.close()
        print("ok")
        """,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_gates_are_off_unless_asked_for(monkeypatch):
    from ft import settings

    monkeypatch.delenv("FT_DECODE_GATES", raising=False)
    assert not settings.decode_gates()
    for value, on in (("0", False), ("no", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("FT_DECODE_GATES", value)
        assert settings.decode_gates() == on, value
