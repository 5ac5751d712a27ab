"""The decode roofline (docs/performance.md): per step, the bytes that must cross each link over
that link's bandwidth. The links work at the same time, so the step can go no faster than its
slowest link:

    t_link    = bytes_link / bandwidth_link          (HBM, PCIe, host memory)
    t_step    = max over links with bytes of t_link
    roofline  = tokens_per_step / t_step             (tok/s)
    ratio     = measured tok/s / roofline

HBM bytes = dense weights read + experts computed on the device from resident weights or cache
slots + the KV cache read; PCIe bytes = experts fetched into slots, or read in place from host
memory by the device (a gated copy past its bound); host bytes = experts computed on the CPU.
The byte counts come from the engine's own counters.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

LINKS = ("hbm", "pcie", "host")


@dataclass(frozen=True)
class Bandwidths:
    """GB/s of each link (None: unknown; that link's time is then not bounded)."""

    hbm_gbs: float | None
    pcie_gbs: float | None
    host_gbs: float | None
    source: dict  # where each figure came from
    note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepBytes:
    hbm: float
    pcie: float
    host: float


def roofline(step: StepBytes, bw: Bandwidths, tokens_per_step: int) -> dict:
    """Per-link seconds, the bound link, the step's lower bound and its tok/s."""
    seconds = {}
    for link in LINKS:
        nbytes, gbs = getattr(step, link), getattr(bw, f"{link}_gbs")
        seconds[f"{link}_s"] = nbytes / (gbs * 1e9) if gbs and nbytes else (0.0 if gbs else None)
    known = {k[:-2]: v for k, v in seconds.items() if v is not None}
    bound = max(known, key=known.get) if known else None
    step_s = known[bound] if bound else None
    tok_s = tokens_per_step / step_s if step_s else None
    unknown = [link for link in LINKS if seconds[f"{link}_s"] is None and getattr(step, link)]
    return {**seconds, "step_s": step_s, "tok_s": tok_s, "bound": bound, "unbounded": unknown}


def measure_device_copy_gbs(device: str, nbytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth from a large device-to-device copy: (read + write) / time."""
    src = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(2 * nbytes / (time.perf_counter() - start) / 1e9)
    del src, dst
    if torch.device(device).type == "cuda":  # cached blocks would count against a memory cap
        torch.cuda.empty_cache()
    return round(statistics.median(samples[2:]), 2)  # the first two warm the allocator and clocks


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bandwidths(device: str, profile_data: dict | None, quick: bool) -> Bandwidths:
    """HBM measured here (or the profile's `hbm_gbs` if it has one); PCIe and host memory from
    the profile's ceilings (`ft bench bw`)."""
    ceilings = (profile_data or {}).get("ceilings") or {}
    hbm = ceilings.get("hbm_gbs")
    source = {"hbm": "profile ceilings.hbm_gbs"}
    if hbm is None:
        hbm = measure_device_copy_gbs(device, (64 if quick else 1024) << 20)
        source["hbm"] = f"measured: {device} memory copy"
    pcie, host = ceilings.get("pcie_linear_h2d_gbs"), ceilings.get("cpu_stream_read_gbs")
    source["pcie"] = "profile ceilings.pcie_linear_h2d_gbs" if pcie else None
    source["host"] = "profile ceilings.cpu_stream_read_gbs" if host else None
    note = None
    if profile_data is None:
        note = "no bandwidth profile (run `ft bench bw`): PCIe and host-memory links unbounded"
    elif pcie is None:
        note = "the profile has no PCIe figure (measured without a GPU)"
    return Bandwidths(hbm, pcie, host, source, note)
