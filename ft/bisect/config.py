"""The search's settings (no scipy here: the CLI checks input before heavy imports)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ft.cpuinfo import allowed_cores
from ft.errors import FtError
from ft.report import plural


@dataclass(frozen=True)
class BisectConfig:
    repeats: int = 3  # samples per commit to start with; the endpoints get twice that
    max_repeats: int = 24  # doubling on "unknown" stops here
    jobs: int = 1
    max_skips: int = 6
    alpha: float = 0.05  # two-sided significance of "differs"

    def __post_init__(self):
        if self.repeats < 1 or self.jobs < 1 or self.max_skips < 0:
            raise FtError("--repeats and --jobs must be at least 1, --max-skips at least 0")
        if self.max_repeats < self.repeats:
            raise FtError(f"--max-repeats {self.max_repeats} is below --repeats {self.repeats}")


def worker_gpus(jobs: int, engine: bool) -> list[str] | None:
    """GPUs handed to workers (round-robin) via CUDA_VISIBLE_DEVICES: the user's own list if set,
    else the GPUs NVML counts (workers share them when there are fewer than --jobs), else
    0..jobs-1."""
    if jobs == 1 and not engine:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    count = _nvml_gpu_count()
    return [str(i) for i in range(min(jobs, count) if count else jobs)]


def interference(jobs: int, engine: bool) -> str | None:
    """Why --jobs measurements at once would slow each other down, if they would: engine mode
    wants a GPU per server (a CPU-only engine takes every core), a --run command at least a
    core (one is left to ft and the system)."""
    if jobs == 1:
        return None
    if engine:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = len([d for d in visible.split(",") if d.strip()]) if visible else _nvml_gpu_count()
        capacity = gpus or 1
        where = plural(gpus, "GPU") if gpus else "no GPU (the engine then takes every core)"
    else:
        cores = len(allowed_cores())
        capacity = max(1, cores - 1)
        where = f"{plural(cores, 'core')}, one of them left to ft and the system"
    if jobs <= capacity:
        return None
    return (
        f"--jobs {jobs} runs {jobs} measurements at once on {where}: they slow each other "
        f"down. Each commit is still compared only with endpoints its own worker measured under "
        f"the same load, but the figures are noisier than with --jobs {capacity}"
    )


def _nvml_gpu_count() -> int:
    """GPUs on this machine by NVML; 0 when there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: nothing to count
        return 0
