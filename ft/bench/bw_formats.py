"""Expert formats `ft bench bw` can measure: every engine format of the registry
(ft.engine.formats), plus `fp32`, the pool's float32 ceiling (not an engine format).

Each says its bytes per expert and whether the CPU MoE executor has a path for it. A format
without a CPU path is still measured over PCIe; the profile then says offload, with its note.
The synthetic store is a host bank in the format's own parts, laid out as the engine's host
store (each expert's parts side by side in one block, what the engine's cache copies), quantised
from float draws for the quantised formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ft.engine.experts.store import expert_blocks
from ft.engine.formats import FORMATS as ENGINE_FORMATS
from ft.engine.formats import ExpertFormat, Part, Parts

FILL_CHUNK = 16  # experts quantised at a time: bounded float memory for a full-size store


@dataclass(frozen=True)
class BenchFormat:
    name: str
    form: ExpertFormat
    dtype: torch.dtype  # the float dtype: bf16 parts, and the activations the engine sends

    @property
    def cpu_path(self) -> bool:
        return self.form.cpu_path

    @property
    def no_cpu_note(self) -> str | None:
        return self.form.no_cpu_note

    def expert_bytes(self, hidden: int, inter: int) -> int:
        return self.form.expert_bytes(hidden, inter, self.dtype)

    def parts(self, hidden: int, inter: int) -> dict[str, Part]:
        return self.form.parts(hidden, inter, self.dtype)

    def make_store(self, experts: int, hidden: int, inter: int, pin: bool) -> tuple[Tensor, Parts]:
        """(blocks [E, block bytes], bank part -> [E, ...] views of them), laid out as the
        engine's host store (expert_blocks); filled (untouched pages would flatter reads)."""
        blocks, bank = expert_blocks(experts, self.parts(hidden, inter), pin_memory=pin)
        scale = hidden**-0.5
        for lo in range(0, experts, FILL_CHUNK):
            n = min(FILL_CHUNK, experts - lo)
            w13 = torch.empty(n, 2 * inter, hidden).uniform_(-scale, scale)
            w2 = torch.empty(n, hidden, inter).uniform_(-scale, scale)
            for name, t in self.form.quantize(w13, w2).items():
                bank[name][lo : lo + n].copy_(t)  # bf16: the float draw, rounded
        return blocks, bank


FORMATS: dict[str, BenchFormat] = {
    **{name: BenchFormat(name, form, torch.bfloat16) for name, form in ENGINE_FORMATS.items()},
    "fp32": BenchFormat("fp32", ENGINE_FORMATS["bf16"], torch.float32),
}
ENGINE_FORMAT_NAMES = tuple(ENGINE_FORMATS)  # what `ft bench bw` measures by default
