"""`ft bench cpu-moe`: the CPU MoE pool's throughput per expert format, experts per call and
tokens, beside the host's read bandwidth measured in the same process (docs/cpu-pool.md).

Experts of qwen3-30b-a3b's shape (D=2048, I=768). Each format's store is at least `store_gib`
and is walked in order, so a call reads experts that no recent call read: no read is a hit in
the CPU's caches. Each format and token count is first checked against float32 torch on the
dequantised weights. GB/s = distinct experts x bytes per expert / median seconds per call, from
submit to wait, as hybrid runs it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.bench.bw_formats import ENGINE_FORMAT_NAMES, FORMATS, BenchFormat
from ft.bench.bw_links import cpu_stream_read_gbs
from ft.engine.cpu.pool import COMPUTE_MODES, CpuMoeExecutor, ExpertJob
from ft.errors import FtError

HIDDEN, INTER = 2048, 768
WARMUP_CALLS = 5  # dropped: the first calls wake sleeping workers and fault in the plan's pages
ROUTER_WEIGHT = 0.5  # every token's weight for every expert of a call


@dataclass(frozen=True)
class CpuMoeBenchConfig:
    formats: tuple[str, ...] = ENGINE_FORMAT_NAMES
    experts_per_call: tuple[int, ...] = (1, 2, 8)  # a layer's CPU share at decode
    tokens: tuple[int, ...] = (1, 4)  # decode batch: every token goes to every expert
    calls: int = 40  # timed calls per cell
    store_gib: float = 1.0  # per format: larger than the CPU's caches
    threads: int | None = None  # pool threads (default: physical cores - 1)
    computes: tuple[str, ...] = ("auto",)  # pool compute modes, e.g. auto,native

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            bad = ", ".join(unknown) or "(none)"
            raise FtError(f"--formats: unknown expert format {bad}; known: {', '.join(FORMATS)}")
        no_cpu = [f for f in self.formats if not FORMATS[f].cpu_path]
        if no_cpu:
            raise FtError(f"--formats: {', '.join(no_cpu)} has no CPU path to measure")
        bad_modes = [c for c in self.computes if c not in COMPUTE_MODES]
        if bad_modes or not self.computes:
            raise FtError(f"--compute must be among {', '.join(COMPUTE_MODES)}, got {bad_modes}")
        for flag, values in (("--experts-per-call", self.experts_per_call),
                             ("--tokens", self.tokens)):  # fmt: skip
            if not values or min(values) < 1:
                raise FtError(f"{flag} takes whole numbers >= 1, got {list(values)}")
        if self.calls < 1 or self.store_gib <= 0:
            raise FtError("--calls must be >= 1 and --store-gib positive")
        if self.threads is not None and self.threads < 1:
            raise FtError(f"--threads must be at least 1, got {self.threads}")


def run_cpu_moe(cfg: CpuMoeBenchConfig, progress: Callable[[str], None] = print) -> dict:
    """{threads, stream_read_gbs, hidden, inter, rows: one per format, compute, tokens and
    experts per call}."""
    with CpuMoeExecutor(threads=cfg.threads) as pool:
        threads = pool.threads  # what the default resolves to on this box
    progress("host read bandwidth")
    read = cpu_stream_read_gbs(1 << 30, threads, 10, 2)
    rows = []
    for name in cfg.formats:
        fmt = FORMATS[name]
        progress(f"{name}: filling a {cfg.store_gib:g} GiB store")
        count = max(4 * max(cfg.experts_per_call), int(cfg.store_gib * 2**30 / _bytes(fmt)) + 1)
        _, bank = fmt.make_store(count, HIDDEN, INTER, pin=False)
        for compute in cfg.computes:
            progress(f"{name}: pool compute={compute}")
            with CpuMoeExecutor(threads=threads, compute=compute) as pool:
                rows += _measure_format(pool, fmt, bank, count, compute, cfg, read)
        del bank  # one format's store in memory at a time
    return dict(threads=threads, stream_read_gbs=read, hidden=HIDDEN, inter=INTER, rows=rows)


def _measure_format(pool, fmt: BenchFormat, bank, count: int, compute: str, cfg, read) -> list:
    rows, cursor = [], 0
    for tokens in cfg.tokens:
        err = _check(pool, fmt, bank, tokens)
        x = torch.randn(tokens, HIDDEN, dtype=fmt.dtype)
        for k in cfg.experts_per_call:
            times = []
            for call in range(WARMUP_CALLS + cfg.calls):
                experts = [(cursor + j) % count for j in range(k)]
                cursor += k
                jobs = _jobs(bank, fmt.form.name, experts, tokens)
                start = time.perf_counter()
                pool.submit(x, jobs).wait()
                if call >= WARMUP_CALLS:
                    times.append(time.perf_counter() - start)
            secs = statistics.median(times)
            gbs = k * _bytes(fmt) / secs / 1e9
            rows.append(dict(
                fmt=fmt.name, compute=compute, tokens=tokens, experts=k, us=round(secs * 1e6, 1),
                gbs=round(gbs, 2), of_read=round(gbs / read, 3) if read else None, max_err=err,
            ))  # fmt: skip
    return rows


def _bytes(fmt: BenchFormat) -> int:
    return fmt.expert_bytes(HIDDEN, INTER)


def _jobs(bank, fmt: str, experts: list[int], tokens: int) -> list[ExpertJob]:
    rows, weights = torch.arange(tokens), torch.full((tokens,), ROUTER_WEIGHT)
    return [ExpertJob({k: t[e] for k, t in bank.items()}, rows, weights, fmt) for e in experts]


def _check(pool: CpuMoeExecutor, fmt: BenchFormat, bank, tokens: int) -> float:
    """Max abs error of a two-expert call against float32 torch on the dequantised weights;
    FtError where it is off by more than float32 rounding (a figure of a wrong kernel is no
    figure)."""
    x = torch.randn(tokens, HIDDEN).to(fmt.dtype)
    jobs = _jobs(bank, fmt.form.name, [0, 1], tokens)
    got = pool.submit(x, jobs).wait()
    want = torch.zeros(tokens, HIDDEN)
    for job in jobs:
        w13, w2 = fmt.form.dequantize(job.parts, torch.float32)
        act = F.silu(x.float() @ w13[:INTER].T) * (x.float() @ w13[INTER:].T)  # [T, I]
        want += ROUTER_WEIGHT * act @ w2.T
    err = (got - want).abs().max().item()
    if err > 1e-3 * max(1.0, want.abs().max().item()):
        raise FtError(f"{fmt.name} T={tokens}: the pool differs from float32 torch by {err:.3g}")
    return err
