"""`ft bench cpu-moe --peer`: the peer's calls interleaved with the pool's on one store, both
checked against float32 first; a peer that computes the wrong thing gives no figure; kt-kernel
absent or an unknown peer is one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from ft.bench import cpu_moe, kt_peer
from ft.bench.bw_formats import FORMATS
from ft.errors import FtError
from tests.conftest import ft_env

TINY = dict(experts_per_call=(1, 2), tokens=(1, 2), calls=2, store_gib=0.001, threads=1)


@pytest.fixture(autouse=True)
def _no_read_bandwidth(monkeypatch):
    """In-process runs skip the host read measurement (seconds; not what these tests check)."""
    monkeypatch.setattr(cpu_moe, "cpu_stream_read_gbs", lambda *args: 10.0)


class TorchPeer:
    """A test peer that really computes: torch on our store's bf16 experts, in bf16 (as kt
    writes its output; float32 would spend the test's seconds converting weights).
    `log` gets (side, experts) of every call, the pool's too (see _log_pool_calls)."""

    name = "torch"

    def __init__(self, log: list, no_path: tuple[str, ...] = (), off: float = 0.0) -> None:
        self.log, self.no_path, self.off, self.started = log, no_path, off, None
        self.started_with = None

    def start(self, threads: int) -> None:
        self.started = self.started_with = threads

    def close(self) -> None:
        self.started = None

    def describe(self) -> dict:
        return dict(name=self.name, version="test", variant="float32")

    def layer(self, fmt, bank, count: int, max_tokens: int, max_k: int):
        if fmt.name in self.no_path:
            return f"no path: the torch peer skips {fmt.name}"
        return TorchLayer(self, fmt, bank)


class TorchLayer:
    name = "torch"
    method = "float32 matmul"
    host_bytes = 0

    def __init__(self, peer: TorchPeer, fmt, bank) -> None:
        self.peer, self.fmt, self.bank = peer, fmt, bank
        self.expert_bytes = fmt.expert_bytes(cpu_moe.HIDDEN, cpu_moe.INTER)
        self.closed = False

    def weights(self, expert: int):
        return self.fmt.form.dequantize({k: t[expert] for k, t in self.bank.items()}, torch.float32)

    def call(self, x, experts, weight):
        def run():
            self.peer.log.append(("peer", list(experts)))
            out = torch.zeros(x.shape[0], cpu_moe.HIDDEN, dtype=x.dtype)
            for e in experts:
                w13, w2 = self.bank["w13"][e], self.bank["w2"][e]
                gate, up = x @ w13[: cpu_moe.INTER].T, x @ w13[cpu_moe.INTER :].T
                out += weight * (F.silu(gate) * up) @ w2.T
            return out + self.peer.off  # off: a wrong kernel

        return run

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def pool_log(monkeypatch):
    """Every call of the pool's side, in order, as ("pool", experts)."""
    log = []
    real = cpu_moe._PoolSide.call

    def logged(self, x, experts, weight):
        run = real(self, x, experts, weight)

        def run_logged():
            log.append(("pool", list(experts)))
            return run()

        return run_logged

    monkeypatch.setattr(cpu_moe._PoolSide, "call", logged)
    return log


@pytest.mark.timeout(120)
def test_peer_calls_interleave_with_the_pool_through_one_store(pool_log):
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16", "int8"), **TINY)
    peer = TorchPeer(pool_log, no_path=("int8",))
    result = cpu_moe.run_cpu_moe(cfg, lambda _: None, peer=peer)
    assert peer.started is None  # closed
    assert peer.started_with == result["threads"]  # a pool as large as ours, its caller beside
    bf16 = [r for r in result["rows"] if r["fmt"] == "bf16"]
    assert {(r["tokens"], r["experts"]) for r in bf16} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for r in bf16:  # both measured, checked, and set side by side
        assert r["gbs"] > 0 and r["peer_gbs"] > 0 and r["peer_note"] is None
        assert r["max_err"] < 1e-3 and r["peer_max_err"] < 5e-3  # the peer's out: bf16
        # the row rounds it to 2 decimals: 0.195 shows as 0.2
        assert r["ratio"] == pytest.approx(r["gbs"] / r["peer_gbs"], rel=0.02, abs=0.006)
    for r in (r for r in result["rows"] if r["fmt"] == "int8"):  # the pool alone
        assert r["gbs"] > 0 and r["peer_gbs"] is None and r["peer_note"].startswith("no path")
    layers = result["peer"]["layers"]
    assert layers["bf16"]["reads_our_store"] is True and layers["int8"]["note"].startswith("no")
    # bf16's calls: per token count, each side's check on experts 0, 1, then pool, peer, pool,
    # ... each on the next experts of the store (one cursor: none read twice in a row)
    count, calls = layers["bf16"]["experts"], pool_log
    cursor, at = 0, 0
    for _tokens in TINY["tokens"]:
        assert calls[at : at + 2] == [("pool", [0, 1]), ("peer", [0, 1])]
        at += 2
        for k in TINY["experts_per_call"]:
            for i in range(2 * (cpu_moe.WARMUP_CALLS + TINY["calls"])):
                side, experts = calls[at]
                assert side == ("pool", "peer")[i % 2]
                assert experts == [(cursor + j) % count for j in range(k)]
                cursor, at = cursor + k, at + 1
    assert calls[at : at + 2] == [("peer", [0, 1])] * 2  # _reads_our_store: before, after
    assert {side for side, _ in calls[at + 2 :]} == {"pool"}  # int8: the pool alone


@pytest.mark.timeout(120)
def test_without_interleave_each_side_runs_its_calls_in_a_block(pool_log, monkeypatch):
    """--no-interleave: per cell the pool's calls back to back, then the peer's, one cursor
    through the store; the process let go idle only before each side's block."""
    settles = []
    monkeypatch.setattr(cpu_moe, "settle", lambda *_: settles.append(len(pool_log)) or True)
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), interleave=False, **TINY)
    result = cpu_moe.run_cpu_moe(cfg, lambda _: None, peer=TorchPeer(pool_log))
    assert result["peer"]["interleave"] is False
    assert all(r["gbs"] > 0 and r["peer_gbs"] > 0 for r in result["rows"])
    count, calls = result["peer"]["layers"]["bf16"]["experts"], pool_log
    block = cpu_moe.WARMUP_CALLS + TINY["calls"]
    cursor, at, starts = 0, 0, []
    for _tokens in TINY["tokens"]:
        at += 2  # the checks
        for k in TINY["experts_per_call"]:
            for side in ("pool", "peer"):
                starts.append(at)
                for _ in range(block):
                    assert calls[at] == (side, [(cursor + j) % count for j in range(k)])
                    cursor, at = cursor + k, at + 1
    assert settles == starts


def test_a_format_the_peer_lacks_still_starts_each_cell_idle(pool_log, monkeypatch):
    """The pool's cells of a format with no peer path follow the peer's calls of the format
    before: its workers may still spin (kt's for ~50 ms), so those cells settle too."""
    settles = []
    monkeypatch.setattr(cpu_moe, "settle", lambda *_: settles.append(len(pool_log)) or True)
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16", "int8"), interleave=False, **TINY)
    cpu_moe.run_cpu_moe(cfg, lambda _: None, peer=TorchPeer(pool_log, no_path=("int8",)))
    cells = len(TINY["tokens"]) * len(TINY["experts_per_call"])
    assert len(settles) == 2 * cells + cells  # bf16: before each side's block; int8: the pool's
    first_int8 = settles[2 * cells]
    assert pool_log[first_int8 - 1][0] == "pool" and all(
        side == "pool" for side, _ in pool_log[first_int8:]
    )  # fmt: skip


def test_a_peer_off_the_reference_fails_the_cell_and_is_never_timed(pool_log):
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), **TINY)
    peer = TorchPeer(pool_log, off=0.05)
    with pytest.raises(FtError, match=r"bf16 T=1: torch differs from float32 torch"):
        cpu_moe.run_cpu_moe(cfg, lambda _: None, peer=peer)
    assert [side for side, _ in pool_log] == ["pool", "peer"]  # the checks, then nothing
    assert peer.started is None  # closed on the way out


def test_settle_waits_for_spinning_threads_then_returns():
    def spin(until: float) -> None:  # as kt's workers do after a call
        while time.perf_counter() < until:
            pass

    start = time.perf_counter()
    assert cpu_moe.settle() is True
    assert time.perf_counter() - start < 0.1  # idle: at once
    spinner = threading.Thread(target=spin, args=(time.perf_counter() + 0.2,))
    spinner.start()
    start = time.perf_counter()
    assert cpu_moe.settle() is True
    waited = time.perf_counter() - start
    spinner.join()
    assert 0.1 < waited < cpu_moe.SETTLE_MAX_S
    # still spinning when the wait runs out: said, so the calls after it are flagged
    spinner = threading.Thread(target=spin, args=(time.perf_counter() + 0.4,))
    spinner.start()
    assert cpu_moe.settle(0.1) is False
    spinner.join()


def test_calls_started_beside_a_busy_process_are_counted_and_said(pool_log, monkeypatch, capsys):
    """A peer's threads still busy after the wait (a settle that gave up): the row counts the
    timed calls that ran beside them, per side, and the table says so under it."""
    waits = []

    def settle(max_s=cpu_moe.SETTLE_MAX_S):
        waits.append(max_s)
        return len(waits) != 1  # the first block, the pool's, starts beside a busy peer

    monkeypatch.setattr(cpu_moe, "settle", settle)
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), interleave=False, **TINY)
    result = cpu_moe.run_cpu_moe(cfg, lambda _: None, peer=TorchPeer(pool_log))
    assert set(waits) == {cpu_moe.BLOCK_SETTLE_MAX_S}  # a block waits longer than a call
    busy = [r["busy_calls"] for r in result["rows"]]
    assert busy[0] == {"pool": TINY["calls"], "peer": 0}
    assert all(b == {"pool": 0, "peer": 0} for b in busy[1:])
    from ft.cli.bench_cpu_moe import _render

    _render(result)
    said = [line for line in capsys.readouterr().out.splitlines() if "still busy" in line]
    r = result["rows"][0]
    assert len(said) == 1
    cell = f"bf16 T={r['tokens']} k={r['experts']}"
    assert said[0].startswith(f"{cell}: {TINY['calls']} of the pool's")


BLOCK_KT = """
import runpy, sys
class NoKt:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kt_kernel":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoKt())
sys.argv = ["ft", *sys.argv[1:]]
runpy.run_module("ft", run_name="__main__")
"""


def test_peer_kt_without_kt_kernel_says_how_to_install_it():
    res = subprocess.run(
        [sys.executable, "-c", BLOCK_KT, "bench", "cpu-moe", "--peer", "kt", "--json"],
        capture_output=True, text=True, timeout=120, env=ft_env(),
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    want = "error: --peer kt needs kt-kernel: pip install --no-deps kt-kernel==0.7.2 (--no-deps:"
    assert res.stderr.startswith(want) and "pins torch==2.9.1" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert res.stdout == ""


def _kt_or_skip():
    """kt-kernel's extension, or a skip: `import kt_kernel` itself needs gguf, which `pip
    install --no-deps` leaves out, so importorskip would skip where the bench runs."""
    try:
        return kt_peer.load_extension()
    except FtError as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(120)
def test_kt_beside_the_pool_keeps_json_on_stdout(capfd):
    _ext, variant, _version = _kt_or_skip()
    from ft.cli.bench_cpu_moe import bench_cpu_moe

    bench_cpu_moe(formats="bf16,int8,fp8_block,nvfp4", experts_per_call="1", tokens="1,2",
                  threads=1, calls=1, store_gib=0.001, compute="auto", peer="kt", settle=True,
                  as_json=True)  # fmt: skip
    result = json.loads(capfd.readouterr().out)  # kt's C++ prints (fd 1) went to stderr
    peer = result["peer"]
    assert peer["name"] == "kt" and peer["variant"] == variant and peer["version"]
    for fmt, layer in peer["layers"].items():
        if "note" in layer:
            assert fmt == "int8" and layer["note"].startswith("no path")
            continue
        assert layer["reads_our_store"] is False  # kt computes from its own copy
    bf16 = peer["layers"]["bf16"]  # the first layer: nothing freed before it to reuse
    assert bf16["rss_mib"] > 0.5 * bf16["held_mib"]
    for r in result["rows"]:
        if r["peer_note"] is None:
            assert r["peer_gbs"] > 0 and r["ratio"] > 0
            assert r["peer_max_err"] < 5e-3  # bf16 out
        else:
            assert r["fmt"] == "int8" and r["peer_gbs"] is None


def test_kt_nvfp4_scales_fold_as_kts_loader_folds_them():
    """kt's NVFP4 scale = e4m3 scale x the tensor's global scale, in bf16, gate's and up's
    global scales on their own rows."""
    fmt = FORMATS["nvfp4"]
    _, bank = fmt.make_store(2, cpu_moe.HIDDEN, cpu_moe.INTER, pin=False)
    scales = kt_peer._kt_scales("nvfp4", bank, cpu_moe.INTER)
    assert scales["w13_scale"].dtype == torch.bfloat16
    for e in range(2):
        gate, up = bank["w13_scale_2"][e]
        s = bank["w13_scale"][e].float()
        assert torch.equal(scales["w13_scale"][e, :5], (s[:5] * gate).bfloat16())
        assert torch.equal(scales["w13_scale"][e, -5:], (s[-5:] * up).bfloat16())
    assert kt_peer._kt_expert_bytes("nvfp4", 2048, 768) == 3 * 2048 * 768 * 3 // 4
