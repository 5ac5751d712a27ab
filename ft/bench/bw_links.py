"""Link measurements for `ft bench bw`: host memory read, PCIe linear copies, and the gather of
whole experts into device cache slots, as the engine's expert cache does it (one copy an expert:
its parts lie side by side in one block, on the host and in the slot).

Every measurement is a list of Samples (one timed batch each); the caller drops warm-ups and
quotes the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ft.engine.experts.store import expert_blocks
from ft.engine.formats import Part


@dataclass(frozen=True)
class Sample:
    start: float  # perf_counter seconds
    end: float
    nbytes: int
    busy_s: float | None = None  # a copy's own time on the GPU (events), where the host's is not

    @property
    def gbs(self) -> float:
        seconds = self.end - self.start if self.busy_s is None else self.busy_s
        return self.nbytes / max(seconds, 1e-9) / 1e9


def timed(fn: Callable[[], int]) -> Sample:
    """Run fn (which returns the bytes it moved) once, as one sample."""
    start = time.perf_counter()
    nbytes = fn()
    return Sample(start, time.perf_counter(), nbytes)


def median_gbs(samples: list[Sample], warmup: int = 0) -> float | None:
    kept = samples[warmup:] or samples
    return round(statistics.median(s.gbs for s in kept), 2) if kept else None


def cpu_stream_read_gbs(nbytes: int, threads: int, repeats: int, warmup: int) -> float | None:
    """Host memory read rate with `threads` torch threads summing one large buffer."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page is real
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples = [timed(lambda: (buf.sum(), buf.numel() * 4)[1]) for _ in range(warmup + repeats)]
    finally:
        torch.set_num_threads(saved)
    return median_gbs(samples, warmup)


def pcie_linear_gbs(
    nbytes: int, device: torch.device, repeats: int, warmup: int
) -> tuple[float | None, float | None]:
    """Pinned host <-> device copies of one contiguous buffer: (H2D, D2H) GB/s."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> int:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        return nbytes

    h2d = [timed(lambda: copy(dev, host)) for _ in range(warmup + repeats)]
    d2h = [timed(lambda: copy(host, dev)) for _ in range(warmup + repeats)]
    return median_gbs(h2d, warmup), median_gbs(d2h, warmup)


class SlotGather:
    """Device cache slots laid out as the engine's (expert_blocks: one block a slot, the
    format's parts side by side in it), filled on a side stream from a pinned host store laid
    out alike: one copy an expert, as the engine's cache."""

    def __init__(
        self, host: torch.Tensor, parts: dict[str, Part], slots: int, device: torch.device
    ):
        self.host = host  # [E, block bytes] pinned host blocks (BenchFormat.make_store)
        # bank: part -> [N, ...] views of the slot blocks (w13, w2 and the format's scales)
        self.blocks, self.bank = expert_blocks(slots, parts, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # CPU: tests
        # counted as the engine's bytes_fetched and the profile's expert_bytes: the parts' bytes
        # (a block's alignment padding, < 64 bytes a part, crosses too but is no expert's)
        self.expert_bytes = sum(p.nbytes for p in parts.values())
        self.slots = slots
        self._next_slot = 0
        if self.stream:  # fetch_asleep's: timed on the GPU, the last one waited on asleep
            self._began = torch.cuda.Event(enable_timing=True)
            self._done = torch.cuda.Event(enable_timing=True, blocking=True)

    def fetch(self, experts: list[int]) -> int:
        """Copy these experts into the next slots (each into its own slot), wait; bytes moved."""
        nbytes = self._queue(experts)
        if self.stream:
            self.stream.synchronize()
        return nbytes

    def fetch_asleep(self, experts: list[int]) -> Sample:
        """fetch's copies, the thread asleep until they land (a blocking event, not CUDA's
        spinning wait) and timed on the GPU. Beside the pool a copier spinning in its wait held
        the core the pool's caller wakes on: on the H100 box every bf16 call then took one
        scheduler tick, 4.0 ms (18.9 GB/s; 59.7-70.8 with the copier asleep). The engine queues
        its copies and spins on none of them while the pool computes. Timed on the GPU, as the
        wake-up after a blocking wait (~0.3 ms there) is no part of the link's time."""
        if not self.stream:
            return timed(lambda: self.fetch(experts))
        start = time.perf_counter()
        self._began.record(self.stream)
        nbytes = self._queue(experts)
        self._done.record(self.stream)
        self._done.synchronize()
        busy_s = self._began.elapsed_time(self._done) / 1e3  # ms -> s
        return Sample(start, time.perf_counter(), nbytes, busy_s)

    def _queue(self, experts: list[int]) -> int:
        """Queue one copy an expert into the next slots (each into its own); bytes queued."""
        with torch.cuda.stream(self.stream) if self.stream else nullcontext():
            for e in experts:
                s, self._next_slot = self._next_slot, (self._next_slot + 1) % self.slots
                self.blocks[s].copy_(self.host[e], non_blocking=True)  # the whole block
        return len(experts) * self.expert_bytes


def gpu_facts(device: torch.device) -> dict:
    """name, and the PCIe link generation / width as NVML reports them (None where it cannot)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = {"name": torch.cuda.get_device_name(index), "pcie_gen": None, "pcie_width": None}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, index)
        facts["pcie_gen"] = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
        facts["pcie_width"] = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
    except Exception:  # no NVML (driver, container): the link stays unknown, the bench goes on
        pass
    return facts


def _nvml_handle(pynvml, index: int):
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:  # older torch: trust that CUDA and NVML number the devices alike
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return pynvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{dev:02x}.0")
