"""NVIDIA GPUs through NVML (nvidia-ml-py): utilisation, memory, SM clock, PCIe link and traffic."""

from __future__ import annotations

import time

# GB/s per lane after line coding, by PCIe generation: link bandwidth = lanes x this.
PCIE_GBS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_link_gbs(gen: int | None, width: int | None) -> float | None:
    """One direction's theoretical bandwidth of a PCIe link, GB/s."""
    if not gen or not width or gen not in PCIE_GBS_PER_LANE:
        return None
    return PCIE_GBS_PER_LANE[gen] * width


def _try(fn, *args):
    """One NVML query; a field the board or driver does not support reads as None."""
    try:
        return fn(*args)
    except Exception:
        return None


class GpuProbe:
    """Samples every NVIDIA GPU; where there is none, every record says unavailable and why.

    Given a pid, only the GPUs that process (or a child) has a context on, where NVML names any:
    on a shared box the other jobs' boards say nothing about the target. Until it has one (or
    where NVML cannot see its processes, as from inside a container) every GPU is sampled.
    """

    def __init__(self, pid: int | None = None):
        self.pid = pid
        self.reason: str | None = None
        self._nvml = None
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            if not self._handles:
                self.reason = "NVML reports no GPU"
        except Exception as exc:  # no library, no driver, no device: all mean "no GPU data"
            self.reason = f"{type(exc).__name__}: {exc}".strip(": ")

    @property
    def available(self) -> bool:
        return self.reason is None

    def sample(self) -> dict:
        record: dict = {"kind": "gpu", "t": time.time()}
        if not self.available:
            return record | {"available": False, "reason": self.reason, "devices": []}
        used = self._used_by_target()
        return record | {
            "available": True,
            "devices": [
                self._device(i, h) for i, h in enumerate(self._handles) if used is None or i in used
            ],
            "target_devices": sorted(used) if used is not None else None,
        }

    def _used_by_target(self) -> set[int] | None:
        """Indices of the GPUs the target's process tree uses; None: unknown (sample them all)."""
        if self.pid is None:
            return None
        from ft.probes.threads import process_tree

        tree = set(process_tree(self.pid))
        used = set()
        for index, h in enumerate(self._handles):
            procs = _try(self._nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            if tree & {p.pid for p in procs}:
                used.add(index)
        return used or None

    def _device(self, index: int, h) -> dict:
        nv = self._nvml
        util = _try(nv.nvmlDeviceGetUtilizationRates, h)
        mem = _try(nv.nvmlDeviceGetMemoryInfo, h)
        rx = _try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)  # KB/s
        tx = _try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        return {
            "index": index,
            "name": _try(nv.nvmlDeviceGetName, h),
            "util_pct": util.gpu if util else None,
            "mem_used_mib": round(mem.used / 2**20) if mem else None,
            "mem_total_mib": round(mem.total / 2**20) if mem else None,
            "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "pcie_gen": _try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width": _try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_rx_bytes_s": rx * 1024 if rx is not None else None,
            "pcie_tx_bytes_s": tx * 1024 if tx is not None else None,
        }

    def driver(self) -> str | None:
        return _try(self._nvml.nvmlSystemGetDriverVersion) if self.available else None

    def close(self) -> None:
        if self._nvml is not None:
            _try(self._nvml.nvmlShutdown)
            self._nvml = None
