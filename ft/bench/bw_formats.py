"""Expert formats `ft bench bw` can measure: how to build a synthetic host store of each.

Each format says its bytes per expert and whether the CPU MoE executor has a path for it. A
format without a CPU path is still measured over PCIe; the profile then says offload, with its
note. To add one (int8, fp8_block, nvfp4 come with their engine formats), register a
BenchFormat below with the store layout the engine's cache copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BenchFormat:
    name: str
    dtype: torch.dtype  # host element type of w13 / w2
    cpu_path: bool = True  # the CPU MoE executor can compute this format
    no_cpu_note: str | None = None  # why not, in the profile's words

    def expert_bytes(self, hidden: int, inter: int) -> int:
        return 3 * hidden * inter * self.dtype.itemsize  # w13 [2I, D] + w2 [D, I]

    def make_store(
        self, experts: int, hidden: int, inter: int, pin: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host w13 [E, 2I, D] and w2 [E, D, I], filled (untouched pages would flatter reads)."""
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=self.dtype, pin_memory=pin)
        w2 = torch.empty(experts, hidden, inter, dtype=self.dtype, pin_memory=pin)
        scale = hidden**-0.5
        return w13.uniform_(-scale, scale), w2.uniform_(-scale, scale)


FORMATS: dict[str, BenchFormat] = {
    "bf16": BenchFormat("bf16", torch.bfloat16),
    "fp32": BenchFormat("fp32", torch.float32),  # not an engine format: the pool's fp32 ceiling
}
