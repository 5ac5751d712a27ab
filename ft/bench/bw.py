"""`ft bench bw`: measure the box and build the schema-4 bandwidth profile (docs/profile.md).

Per expert format: `cpu_moe_gbs`, expert bytes per second computed by the real CpuMoeExecutor at
decode batch (one token, a few experts per submit, as a layer's CPU share); `pcie_gather_gbs`,
expert bytes per second copied from pinned host memory into device cache slots on a side
stream; and the `_overlap_` pair, the same two while both run at once. Warm-ups are dropped and
medians quoted. Without a GPU the PCIe fields are null with a note, and the format says offload.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from ft import __version__, cpuinfo
from ft.bench.bw_formats import ENGINE_FORMAT_NAMES, FORMATS, BenchFormat
from ft.bench.bw_links import (
    Sample,
    SlotGather,
    cpu_stream_read_gbs,
    gpu_facts,
    median_gbs,
    pcie_linear_gbs,
    timed,
)
from ft.engine.cpu.compute import describe_compute
from ft.engine.cpu.pool import CpuMoeExecutor
from ft.errors import FtError
from ft.profile import DEFAULT_THRESHOLD, VERSION, apply_rules, check

NO_GPU_NOTE = "no CUDA GPU: PCIe not measured, so hybrid cannot be recommended"


@dataclass(frozen=True)
class BwConfig:
    formats: tuple[str, ...] = ENGINE_FORMAT_NAMES  # bf16, int8, fp8_block, nvfp4
    threads: int | None = None  # CPU MoE pool threads (default: physical cores - 1)
    threshold: float = DEFAULT_THRESHOLD
    quick: bool = False  # small synthetic experts, few samples: under a minute on 2 cores
    device: str | None = None  # "cuda" / "cuda:1"; default: CUDA when present

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise FtError(f"--threads must be at least 1, got {self.threads}")
        if self.threshold <= 0:
            raise FtError(f"--threshold must be positive, got {self.threshold}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            bad = ", ".join(unknown) or "(none)"
            raise FtError(f"--formats: unknown expert format {bad}; known: {', '.join(FORMATS)}")

    # Full runs use qwen3-30b-a3b's expert shape; --quick a small one that fits a CI box.
    hidden = property(lambda self: 512 if self.quick else 2048)
    inter = property(lambda self: 256 if self.quick else 768)
    synth_experts = property(lambda self: 32 if self.quick else 128)
    experts_per_step = property(lambda self: 4 if self.quick else 8)  # a layer's CPU share
    samples = property(lambda self: 8 if self.quick else 30)
    warmup = property(lambda self: 2 if self.quick else 4)
    read_bytes = property(lambda self: (64 if self.quick else 1024) << 20)
    link_bytes = property(lambda self: (32 if self.quick else 256) << 20)


def run_bw(cfg: BwConfig, on_stage: Callable[[str], None] = lambda _: None) -> dict:
    """Measure everything and return the profile dict (rules applied, checked)."""
    device = _device(cfg)
    on_stage("host memory read")
    ceilings = {
        "cpu_stream_read_gbs": cpu_stream_read_gbs(
            cfg.read_bytes, cpuinfo.physical_cores(), cfg.samples, cfg.warmup
        ),
        "pcie_linear_h2d_gbs": None,
        "pcie_linear_d2h_gbs": None,
    }
    gpu = None
    if device is not None:
        on_stage("PCIe linear copies")
        h2d, d2h = pcie_linear_gbs(cfg.link_bytes, device, cfg.samples, cfg.warmup)
        ceilings.update(pcie_linear_h2d_gbs=h2d, pcie_linear_d2h_gbs=d2h)
        gpu = gpu_facts(device)  # after the copies: an idle link reports a lower generation
    with CpuMoeExecutor(threads=cfg.threads) as pool:
        kernels = {
            name: measure_format(FORMATS[name], cfg, pool, device, on_stage) for name in cfg.formats
        }
        threads_used = pool.threads
    profile = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "version": VERSION,
        "cpu": {
            "physical_cores": cpuinfo.physical_cores(),
            "threads_used": threads_used,
            "model": cpuinfo.model_name(),
            "isa": cpuinfo.best_isa(),
        },
        "gpu": gpu,
        "threshold": cfg.threshold,
        "ceilings": ceilings,
        "dtypes": {},
        "dtype_kernels": kernels,
        "bench": _metadata(cfg),
    }
    check(apply_rules(profile))
    return profile


def measure_format(fmt: BenchFormat, cfg: BwConfig, pool: CpuMoeExecutor, device, on_stage) -> dict:
    on_stage(f"{fmt.name}: synthetic experts")
    store = fmt.make_store(cfg.synth_experts, cfg.hidden, cfg.inter, pin=device is not None)
    bench = _FormatBench(fmt, cfg, pool, store, device)
    kernel = {
        "expert_bytes": fmt.expert_bytes(cfg.hidden, cfg.inter),
        "synth_experts": cfg.synth_experts,
        "cpu_moe_gbs": None,
        "cpu_moe_isa": None,
        "isa_sweep": None,
        "pcie_gather_gbs": None,
        "cpu_moe_overlap_gbs": None,
        "pcie_gather_overlap_gbs": None,
        "ratio": None,
        "recommended": "offload",
        "note": None if fmt.cpu_path else fmt.no_cpu_note,
    }
    if fmt.cpu_path:
        on_stage(f"{fmt.name}: CPU MoE pool")
        kernel["cpu_moe_gbs"] = median_gbs(bench.cpu_samples(cfg.warmup + cfg.samples), cfg.warmup)
        kernel["cpu_moe_isa"] = cpuinfo.best_isa()
        kernel["cpu_moe_compute"] = describe_compute(pool.compute, fmt.form, fmt.dtype)
        if not cfg.quick and fmt.dtype != torch.float32 and not fmt.form.quantized:
            on_stage(f"{fmt.name}: compute path sweep")
            kernel["isa_sweep"] = bench.compute_sweep()
    if device is None:
        kernel["note"] = kernel["note"] or NO_GPU_NOTE
        return kernel
    on_stage(f"{fmt.name}: PCIe gather into cache slots")
    kernel["pcie_gather_gbs"] = median_gbs(
        bench.gather_samples(cfg.warmup + cfg.samples), cfg.warmup
    )
    if fmt.cpu_path:
        on_stage(f"{fmt.name}: CPU MoE and PCIe gather together")
        kernel["cpu_moe_overlap_gbs"], kernel["pcie_gather_overlap_gbs"] = bench.overlapped()
    return kernel


class _FormatBench:
    """The decode-batch steps of one format: pool submits, slot gathers, and both at once."""

    def __init__(
        self, fmt: BenchFormat, cfg: BwConfig, pool, store: tuple[torch.Tensor, dict], device
    ) -> None:
        self.fmt, self.cfg, self.pool = fmt, cfg, pool
        blocks, self.bank = store  # BenchFormat.make_store: (host blocks, part -> views)
        self.expert_bytes = fmt.expert_bytes(cfg.hidden, cfg.inter)
        self.x = torch.randn(1, cfg.hidden, dtype=fmt.dtype)  # decode batch: one token
        parts, slots = fmt.parts(cfg.hidden, cfg.inter), 2 * cfg.experts_per_step
        self.gather = None if device is None else SlotGather(blocks, parts, slots, device)
        self._cursor = {"cpu": 0, "gpu": cfg.synth_experts // 2}  # the two sides read apart

    def _next_experts(self, side: str) -> list[int]:
        k, n = self.cfg.experts_per_step, self.cfg.synth_experts
        start = self._cursor[side]
        self._cursor[side] = (start + k) % n  # walk the store: no expert is warm in cache
        return [(start + j) % n for j in range(k)]

    def cpu_step(self, pool: CpuMoeExecutor | None = None) -> int:
        """One decode step's CPU share, called as hybrid calls it (submit_routed: the layer's
        routing and bank, no job per expert). A job per expert, as this timed before, read less
        than hybrid gets: the 15-thread GPU boxes' profiles 101.8 and 63.1 GB/s bf16 where
        `ft bench cpu-moe` read 122-126 and 90-106; on the 2-core Zen 2 box, alternated twice,
        bf16 23.2 -> 24.4-26.3 GB/s and nvfp4 11.7-12.2 -> 14.4-15.4 this way."""
        experts = self._next_experts("cpu")
        ids = torch.tensor([experts])  # one token routed to each of the step's experts
        weights = torch.ones(ids.shape)
        (pool or self.pool).submit_routed(
            self.x, self.bank, self.fmt.form.name, ids, weights, experts
        ).wait()
        return len(experts) * self.expert_bytes

    def cpu_samples(self, n: int, pool: CpuMoeExecutor | None = None) -> list[Sample]:
        return [timed(lambda: self.cpu_step(pool)) for _ in range(n)]

    def gather_samples(self, n: int) -> list[Sample]:
        return [timed(lambda: self.gather.fetch(self._next_experts("gpu"))) for _ in range(n)]

    def compute_sweep(self) -> dict[str, float | None]:
        """cpu_moe_gbs of each CPU compute path, to check the executor's choice on this box."""
        sweep = {}
        for mode in ("float32", "native", "compiled"):
            with CpuMoeExecutor(cores=self.pool.cores, compute=mode) as pool:
                samples = self.cpu_samples(self.cfg.warmup + self.cfg.samples, pool)
            name = describe_compute(mode, self.fmt.form, self.fmt.dtype)
            sweep[name] = median_gbs(samples, self.cfg.warmup)
        return sweep

    def overlapped(self) -> tuple[float | None, float | None]:
        """Copies loop on a side thread while the pool computes; keep what ran in both. The
        copier sleeps in its waits (SlotGather.fetch_asleep), as no engine thread spins on a
        copy while the pool computes."""
        stop, warmed, gpu = threading.Event(), threading.Event(), []

        def copy_loop() -> None:
            while not stop.is_set():
                gpu.append(self.gather.fetch_asleep(self._next_experts("gpu")))
                if len(gpu) > self.cfg.warmup:
                    warmed.set()

        copier = threading.Thread(target=copy_loop, name="ft-bench-gather")
        copier.start()
        try:
            # the pool is timed beside copies past their warm-up: on a busy 2-core box the
            # copier could otherwise get no turn before the pool's short run ends (no figure)
            warmed.wait(timeout=60)
            cpu = self.cpu_samples(self.cfg.warmup + self.cfg.samples)
        finally:
            stop.set()
            copier.join()
        cpu = cpu[self.cfg.warmup :]
        lo, hi = cpu[0].start, cpu[-1].end  # the window in which the pool was measured
        gpu = [s for s in gpu if s.start >= lo and s.end <= hi] or gpu[self.cfg.warmup :]
        return median_gbs(cpu), median_gbs(gpu)


def _device(cfg: BwConfig) -> torch.device | None:
    if cfg.device is not None:
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise FtError(f"--device {cfg.device}: no CUDA GPU is visible")
        return torch.device(cfg.device) if cfg.device != "cpu" else None
    return torch.device("cuda") if torch.cuda.is_available() else None


def _metadata(cfg: BwConfig) -> dict:
    """How the numbers were taken (pyperf/llama-bench style: every result carries its setup)."""
    return {
        "ft": __version__,
        "torch": torch.__version__,
        "quick": cfg.quick,
        "hidden": cfg.hidden,
        "intermediate": cfg.inter,
        "tokens_per_step": 1,
        "experts_per_step": cfg.experts_per_step,
        "samples": cfg.samples,
        "warmup_dropped": cfg.warmup,
        "statistic": "median",
    }
