"""`bf16`: unquantised experts in the checkpoint's float dtype (bf16, fp16 or fp32: the name
means "as the checkpoint stores them"). Parts: w13 [2I, D], w2 [D, I]."""

from __future__ import annotations

import numpy as np
import torch

from ft.engine.formats.base import ExpertFormat, Part, Parts


class FloatFormat(ExpertFormat):
    name = "bf16"
    quantized = False

    def parts(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, Part]:
        return {"w13": Part((2 * inter, hidden), dtype), "w2": Part((hidden, inter), dtype)}

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Parts:
        return {"w13": w13, "w2": w2}  # the caller stores them in the checkpoint's dtype

    def w13_rows(self, parts: Parts, r0: int, r1: int, out: torch.Tensor) -> None:
        out.copy_(parts["w13"][..., r0:r1, :])

    def w2_cols(self, parts: Parts, c0: int, c1: int, out: torch.Tensor) -> None:
        out.copy_(parts["w2"][..., c0:c1])

    def dequantize(self, parts: Parts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return parts["w13"].to(dtype), parts["w2"].to(dtype)  # no copy in the engine's dtype

    def slot_weights(self, bank: Parts, slot: int, dtype: torch.dtype):
        return bank["w13"][slot].to(dtype), bank["w2"][slot].to(dtype)  # views, no dict

    def rows_dot(self, parts: Parts, name: str, r0: int, r1: int, c0: int, x, out) -> None:
        from ft.engine.cpu import kernels as cpu_kernels  # numba: imported where it is used

        w = parts[name]
        if w.dtype == torch.bfloat16:  # its bits: numpy has no bfloat16
            bits = w.view(torch.int16).numpy().view(np.uint16)
            cpu_kernels.bf16_rows(x, bits, r0, r1, c0, out)
        else:  # float32 (COMPILED_FLOATS)
            cpu_kernels.float_rows(x, w.numpy(), r0, r1, c0, out)

    def checkpoint_shape(self, suffix: str, rows: int, cols: int) -> tuple[int, ...]:
        return (rows, cols)

    def matches(self, config: dict | None) -> bool:
        return config is None
