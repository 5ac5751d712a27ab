"""The search's settings (no scipy here: the CLI checks input before heavy imports)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ft.errors import FtError


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
    """One GPU per worker via CUDA_VISIBLE_DEVICES: the user's own list if set, else 0..jobs-1."""
    if jobs == 1 and not engine:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(jobs)]
