"""`ft bench bw`: a valid schema-4 profile on the CPU, measured through the real executor."""

from __future__ import annotations

import json

import pytest
import torch

from ft.bench import bw as bw_mod
from ft.bench.bw import NO_GPU_NOTE, BwConfig, _FormatBench, measure_format, run_bw
from ft.bench.bw_formats import ENGINE_FORMAT_NAMES, FORMATS, BenchFormat
from ft.engine.config import EXPERT_FORMATS
from ft.engine.cpu.pool import THREAD_PREFIX, CpuMoeExecutor
from ft.engine.formats.int8 import Int8Format
from ft.errors import FtError
from ft.profile import decide, load_profile
from tests.conftest import run_ft


class RecordingExecutor(CpuMoeExecutor):
    """The real executor, remembering the threads and counters of its work for the test."""

    made: list[RecordingExecutor] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ran_on: set[str] = set()
        self.routed: list[int] = []  # experts of each submit_routed call (hybrid's call)
        RecordingExecutor.made.append(self)

    def submit(self, x, jobs):
        handle = super().submit(x, jobs)
        handle.wait()
        self.ran_on |= handle.ran_on
        return handle

    def submit_routed(self, x, bank, fmt, topk_ids, topk_weights, experts):
        self.routed.append(len(experts))
        handle = super().submit_routed(x, bank, fmt, topk_ids, topk_weights, experts)
        handle.wait()
        self.ran_on |= handle.ran_on
        return handle


def test_cpu_numbers_come_from_the_pool(monkeypatch):
    RecordingExecutor.made.clear()
    monkeypatch.setattr(bw_mod, "CpuMoeExecutor", RecordingExecutor)
    cfg = BwConfig(formats=("bf16", "fp32"), quick=True, threads=1, device="cpu")
    stages: list[str] = []
    profile = run_bw(cfg, stages.append)
    (pool,) = RecordingExecutor.made
    steps = (cfg.warmup + cfg.samples) * len(cfg.formats)
    assert pool.stats.experts_in_pool == steps * cfg.experts_per_step
    assert pool.routed == [cfg.experts_per_step] * steps  # each step called as hybrid calls it
    assert pool.stats.experts_inline == 0
    assert pool.ran_on and all(n.startswith(THREAD_PREFIX) for n in pool.ran_on)
    kernel = profile["dtype_kernels"]["bf16"]
    assert kernel["cpu_moe_gbs"] > 0 and kernel["expert_bytes"] == 3 * 512 * 256 * 2
    assert kernel["pcie_gather_gbs"] is None and kernel["note"] == NO_GPU_NOTE
    assert profile["gpu"] is None and profile["ceilings"]["pcie_linear_h2d_gbs"] is None
    assert profile["cpu"]["threads_used"] == 1
    assert any("CPU MoE pool" in s for s in stages)


def test_gather_and_overlap_logic_on_cpu_slots():
    """The slot gather and the overlapped pair, with CPU buffers standing in for the device."""
    cfg = BwConfig(quick=True, threads=1, device="cpu")
    store = FORMATS["bf16"].make_store(cfg.synth_experts, cfg.hidden, cfg.inter, pin=False)
    _, bank = store
    with CpuMoeExecutor(threads=1) as pool:
        bench = _FormatBench(FORMATS["bf16"], cfg, pool, store, torch.device("cpu"))
        samples = bench.gather_samples(3)
        k = cfg.experts_per_step
        assert [s.nbytes for s in samples] == [k * bench.expert_bytes] * 3
        last = (3 * k - 1 + cfg.synth_experts // 2) % cfg.synth_experts  # the gather's cursor
        slot = (3 * k - 1) % (2 * k)  # each expert into its own slot, round robin
        assert torch.equal(bench.gather.bank["w13"][slot], bank["w13"][last])
        assert torch.equal(bench.gather.bank["w2"][slot], bank["w2"][last])
        cpu_gbs, gather_gbs = bench.overlapped()
    assert cpu_gbs > 0 and gather_gbs > 0


def test_a_copy_timed_on_the_gpu_is_rated_by_that_time():
    """Beside the pool the copier sleeps in its waits and its copies are timed by events: the
    host's wake-up after them is not the link's time."""
    from ft.bench.bw_links import Sample

    assert Sample(10.0, 11.0, 2 * 10**9).gbs == 2.0  # host-timed
    assert Sample(10.0, 11.0, 2 * 10**9, busy_s=0.5).gbs == 4.0


def test_overlap_waits_for_copies_past_their_warm_up():
    """Copies much slower than the pool's whole run still give a figure: the pool is timed only
    once the copier is past its warm-up (on a busy 2-core box it once got no turn at all)."""
    import time

    cfg = BwConfig(quick=True, threads=1, device="cpu")
    store = FORMATS["bf16"].make_store(cfg.synth_experts, cfg.hidden, cfg.inter, pin=False)
    with CpuMoeExecutor(threads=1) as pool:
        bench = _FormatBench(FORMATS["bf16"], cfg, pool, store, torch.device("cpu"))
        fetch = bench.gather.fetch
        bench.gather.fetch = lambda ids: (time.sleep(0.05), fetch(ids))[1]
        cpu_gbs, gather_gbs = bench.overlapped()
    assert cpu_gbs > 0 and gather_gbs > 0


def test_config_errors():
    with pytest.raises(FtError, match="unknown"):
        BwConfig(formats=("nvfp5",))
    with pytest.raises(FtError, match="threshold"):
        BwConfig(threshold=0)


@pytest.mark.timeout(180)
def test_cli_quick_writes_a_valid_profile(tmp_path):
    out = tmp_path / "bw.json"
    res = run_ft("bench", "bw", "--quick", "--out", str(out), "--json", "--threshold", "1.5")
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    profile = load_profile(out)
    assert profile.data == printed and profile.data["version"] == 4
    assert tuple(profile.data["dtype_kernels"]) == EXPERT_FORMATS  # every format by default
    assert profile.threshold == 1.5
    if not torch.cuda.is_available():
        kernel = profile.data["dtype_kernels"]["bf16"]
        assert kernel["pcie_gather_gbs"] is None and kernel["pcie_gather_overlap_gbs"] is None
        d = decide(profile, "bf16")
        assert d.recommended == "offload" and "no CUDA GPU" in d.note


@pytest.mark.timeout(120)
def test_cli_bad_format_is_one_line():
    res = run_ft("bench", "bw", "--quick", "--formats", "bf16,nvfp5", "--out", "/nonexistent/x")
    assert res.returncode == 1 and res.stderr.startswith("error: --formats")
    assert "Traceback" not in res.stderr


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_quick_profile_has_pcie_and_overlap():
    profile = run_bw(BwConfig(quick=True))
    kernel = profile["dtype_kernels"]["bf16"]
    for key in ("pcie_gather_gbs", "cpu_moe_overlap_gbs", "pcie_gather_overlap_gbs"):
        assert kernel[key] > 0, key
    assert profile["gpu"]["name"] and profile["ceilings"]["pcie_linear_h2d_gbs"] > 0
    assert decide(profile, "bf16").fetch_fraction is not None


def test_cli_table_and_default_path(monkeypatch, tmp_path):
    """The human path: a table with the recommendation, the profile at $FT_CACHE_DIR."""
    from typer.testing import CliRunner

    from ft.cli.app import app

    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["bench", "bw", "--quick", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "recommended" in result.output and "offload" in result.output
    assert load_profile(tmp_path / "benchbw.json").data["cpu"]["threads_used"] == 1


def test_every_engine_format_is_measured_through_its_cpu_path():
    """Quantised formats: their own bytes per expert, the pool's dequantising path (CPU box:
    no PCIe, so offload with the no-GPU note)."""
    cfg = BwConfig(quick=True, threads=1, device="cpu")
    profile = run_bw(cfg)
    assert tuple(profile["dtype_kernels"]) == EXPERT_FORMATS
    for name, kernel in profile["dtype_kernels"].items():
        assert kernel["expert_bytes"] == FORMATS[name].form.expert_bytes(512, 256)
        assert kernel["cpu_moe_gbs"] > 0 and kernel["pcie_gather_gbs"] is None
        assert kernel["recommended"] == "offload" and kernel["note"] == NO_GPU_NOTE
    sizes = [profile["dtype_kernels"][f]["expert_bytes"] for f in EXPERT_FORMATS]
    assert sizes == sorted(sizes, reverse=True)  # bf16 > int8 > fp8_block > nvfp4


@pytest.mark.parametrize("name", ENGINE_FORMAT_NAMES)
def test_gather_copies_each_expert_s_whole_block_once(monkeypatch, name):
    """As the engine's cache: the host store and the slots are laid out as expert_blocks, so an
    expert crosses in one copy of its block row, and the slot's views then hold every part."""
    cfg = BwConfig(quick=True, threads=1, device="cpu")
    fmt = FORMATS[name]
    blocks, bank = fmt.make_store(cfg.synth_experts, cfg.hidden, cfg.inter, pin=False)
    assert all(
        t.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr() for t in bank.values()
    )
    copies, real_copy = [], torch.Tensor.copy_

    def counted_copy(dst, src, **kw):
        copies.append((dst, src))
        return real_copy(dst, src, **kw)

    with CpuMoeExecutor(threads=1) as pool:
        bench = _FormatBench(fmt, cfg, pool, (blocks, bank), torch.device("cpu"))
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        (sample,) = bench.gather_samples(1)
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    k, first = cfg.experts_per_step, cfg.synth_experts // 2  # where the gather's cursor starts
    slots = bench.gather.blocks
    assert [(d.data_ptr(), s.data_ptr()) for d, s in copies] == [
        (slots[j].data_ptr(), blocks[first + j].data_ptr()) for j in range(k)
    ]  # one copy an expert: its whole block row into its slot's
    assert all(d.shape == s.shape == (blocks.shape[1],) for d, s in copies)
    assert sample.nbytes == k * fmt.expert_bytes(cfg.hidden, cfg.inter)  # the parts' bytes
    assert set(bench.gather.bank) == set(bank) == set(fmt.form.parts(1, 1, torch.bfloat16))
    for part_name, part in bench.gather.bank.items():
        for j in range(k):  # as bytes: a quantised part may hold NaN bit patterns
            got, want = part[j].view(torch.uint8), bank[part_name][first + j].view(torch.uint8)
            assert torch.equal(got, want), (part_name, j)


class _NoCpuInt8(Int8Format):
    cpu_path = False
    no_cpu_note = "CPU MoE has no int8 weight path; hybrid unavailable"


def test_a_format_without_a_cpu_path_says_offload_with_its_note():
    cfg = BwConfig(quick=True, threads=1, device="cpu")
    fmt = BenchFormat("int8", _NoCpuInt8(), torch.bfloat16)
    with CpuMoeExecutor(threads=1) as pool:
        kernel = measure_format(fmt, cfg, pool, None, lambda _: None)
    assert kernel["cpu_moe_gbs"] is None and kernel["note"] == _NoCpuInt8.no_cpu_note
    d = decide({"threshold": 2.0, "dtype_kernels": {"int8": kernel}}, "int8")
    assert d.recommended == "offload" and d.note == _NoCpuInt8.no_cpu_note
