"""Expert formats `ft bench bw` can measure: every engine format of the registry
(ft.engine.formats), plus `fp32`, the pool's float32 ceiling (not an engine format).

Each says its bytes per expert and whether the CPU MoE executor has a path for it. A format
without a CPU path is still measured over PCIe; the profile then says offload, with its note.
The synthetic store is a host bank in the format's own parts (what the engine's cache copies),
quantised from float draws for the quantised formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.engine.formats import FORMATS as ENGINE_FORMATS
from ft.engine.formats import ExpertFormat

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

    def make_store(self, experts: int, hidden: int, inter: int, pin: bool) -> dict:
        """A host bank (part -> [E, ...]), filled (untouched pages would flatter reads)."""
        parts = self.form.parts(hidden, inter, self.dtype)
        bank = {
            name: torch.empty(experts, *p.shape, dtype=p.dtype, pin_memory=pin)
            for name, p in parts.items()
        }
        scale = hidden**-0.5
        for lo in range(0, experts, FILL_CHUNK):
            n = min(FILL_CHUNK, experts - lo)
            w13 = torch.empty(n, 2 * inter, hidden).uniform_(-scale, scale)
            w2 = torch.empty(n, hidden, inter).uniform_(-scale, scale)
            for name, t in self.form.quantize(w13, w2).items():
                bank[name][lo : lo + n].copy_(t)  # bf16: the float draw, rounded
        return bank


FORMATS: dict[str, BenchFormat] = {
    **{name: BenchFormat(name, form, torch.bfloat16) for name, form in ENGINE_FORMATS.items()},
    "fp32": BenchFormat("fp32", ENGINE_FORMATS["bf16"], torch.float32),
}
ENGINE_FORMAT_NAMES = tuple(ENGINE_FORMATS)  # what `ft bench bw` measures by default
