"""`nvfp4`: NVIDIA ModelOpt's NVFP4, weight-only: e2m1 values, an e4m3 scale per 16 elements
along the input dim, and a float32 global scale per tensor.

w[r, k] = e2m1(code[r, k]) * float(scale[r, k // 16]) * scale_2, with (ModelOpt's recipe)
scale_2 = amax(tensor) / (6 * 448), scale = e4m3(amax(group of 16) / 6 / scale_2) and code the
nearest e2m1 of w / (scale * scale_2). Two codes a byte: element 2j in the LOW nibble.
Parts: w13 uint8 [2I, D/2], w13_scale e4m3 [2I, D/16], w13_scale_2 float32 [2] (gate, up: row
r uses [r // I]), w2 uint8 [D, I/2], w2_scale e4m3 [D, I/16], w2_scale_2 float32 [1].
Checkpoint: `{proj}.weight` uint8 [R, C/2], `.weight_scale` e4m3 [R, C/16], `.weight_scale_2`
float32 [] and `.input_scale` float32 [] (written 1.0; ignored: activations stay float).
"""

from __future__ import annotations

import numpy as np
import torch

from ft.engine.formats.base import (
    E4M3,
    E4M3_TABLE,
    E4M3_VALUES,
    ExpertFormat,
    Part,
    Parts,
    check_multiple,
    code_table,
    decode_into,
)

GROUP = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude of codes 0..7
CODES = torch.cat((E2M1, -E2M1))  # code (sign bit 8) -> value
BYTE_PAIRS = torch.stack((CODES[torch.arange(256) & 15], CODES[torch.arange(256) >> 4]), -1)
CODES_TABLE = CODES.numpy()  # for the CPU kernels (float32)
MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2  # nearest e2m1 magnitude: bucketize against these
SCALE_MAX = 6.0 * 448.0  # largest e2m1 x largest e4m3


class Nvfp4Format(ExpertFormat):
    name = "nvfp4"
    align = GROUP  # a CPU block of I covers whole groups of w2's columns
    tensors = {"weight": "", "weight_scale": "_scale", "weight_scale_2": "_scale_2"}
    constants = {"input_scale": 1.0}

    def parts(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, Part]:
        return {
            "w13": Part((2 * inter, hidden // 2), torch.uint8),
            "w13_scale": Part((2 * inter, hidden // GROUP), E4M3),
            "w13_scale_2": Part((2,), torch.float32),
            "w2": Part((hidden, inter // 2), torch.uint8),
            "w2_scale": Part((hidden, inter // GROUP), E4M3),
            "w2_scale_2": Part((1,), torch.float32),
        }

    def check_shape(self, hidden: int, inter: int) -> None:
        check_multiple(self.name, hidden, inter, GROUP)

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Parts:
        self.check_shape(w2.shape[-2], w2.shape[-1])
        inter = w13.shape[-2] // 2
        projections = (w13[..., :inter, :], w13[..., inter:, :], w2)
        gate, up, down = (quantize_tensor(w) for w in projections)
        return {
            "w13": torch.cat((gate[0], up[0]), -2),
            "w13_scale": torch.cat((gate[1], up[1]), -2),
            "w13_scale_2": torch.stack((gate[2], up[2]), -1),
            "w2": down[0], "w2_scale": down[1], "w2_scale_2": down[2][..., None],
        }  # fmt: skip

    def w13_rows(self, parts: Parts, r0: int, r1: int, out: torch.Tensor) -> None:
        which = torch.arange(r0, r1) // self.inter_of(parts)  # 0: gate, 1: up
        scale = _e4m3(parts["w13_scale"][..., r0:r1, :])  # [..., n, D/16]
        scale *= parts["w13_scale_2"][..., which, None]
        _decode(parts["w13"][..., r0:r1, :], scale, out)

    def w2_cols(self, parts: Parts, c0: int, c1: int, out: torch.Tensor) -> None:
        assert c0 % GROUP == 0 and c1 % GROUP == 0, "CPU blocks of I are aligned to 16"
        scale = _e4m3(parts["w2_scale"][..., c0 // GROUP : c1 // GROUP])  # [..., D, s/16]
        scale *= parts["w2_scale_2"][..., None]
        _decode(parts["w2"][..., c0 // 2 : c1 // 2], scale, out)

    def rows_dot(self, parts: Parts, name: str, r0: int, r1: int, c0: int, x, out) -> None:
        from ft.engine.cpu import kernels as cpu_kernels  # numba: imported where it is used

        scale_2 = parts[f"{name}_scale_2"].numpy()
        if name == "w13":  # gate's global scale, then up's
            row_scale2 = scale_2[np.arange(r0, r1) // self.inter_of(parts)]
        else:
            row_scale2 = np.full(r1 - r0, scale_2[0], np.float32)
        scales = parts[f"{name}_scale"].view(torch.uint8).numpy()
        cpu_kernels.nvfp4_rows(x, parts[name].numpy(), CODES_TABLE, r0, r1, c0, scales,
                               E4M3_TABLE, row_scale2, out)  # fmt: skip

    def checkpoint_shape(self, suffix: str, rows: int, cols: int) -> tuple[int, ...]:
        return {"weight": (rows, cols // 2), "weight_scale": (rows, cols // GROUP)}.get(suffix, ())

    def quantization_config(self) -> dict:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"]}  # fmt: skip

    def matches(self, config: dict | None) -> bool:
        return (
            bool(config)
            and config.get("quant_method") == "modelopt"
            and config.get("quant_algo") == "NVFP4"
            and config.get("group_size", GROUP) == GROUP
        )


def _e4m3(scale: torch.Tensor) -> torch.Tensor:
    """float32 of e4m3 scales, by table (torch's float8 conversion is element by element)."""
    out = torch.empty(scale.shape, dtype=torch.float32)
    decode_into(code_table(E4M3_VALUES, torch.float32), scale.view(torch.uint8), out)
    return out


def _decode(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out [..., n, C] = e2m1 values of packed [..., n, C/2] x scale [..., n, C/16] per group:
    one table lookup of both nibbles of each byte, then one multiply in out's dtype."""
    decode_into(code_table(BYTE_PAIRS, out.dtype), packed, out)  # low nibble first
    groups = out.view(*out.shape[:-1], -1, GROUP)  # [..., n, C/16, 16]
    per_element = scale.to(out.dtype)[..., None].expand(groups.shape)  # a broadcast over 16
    groups.mul_(per_element.contiguous())  # is ~3x slower on the CPU than this copy + multiply


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., R, C] float -> (codes uint8 [..., R, C/2], scale e4m3 [..., R, C/16],
    scale_2 float32 [...]), one global scale per tensor of the leading dims."""
    w = w.float()
    amax = w.abs().amax((-2, -1))  # [...]
    scale_2 = torch.where(amax > 0, amax / SCALE_MAX, 1.0)
    groups = w.unflatten(-1, (-1, GROUP))  # [..., R, C/16, 16]
    want = groups.abs().amax(-1) / 6.0 / scale_2[..., None, None]
    scale = want.clamp_(max=448.0).to(E4M3)  # [..., R, C/16]
    step = scale.float() * scale_2[..., None, None]  # what a code of 1.0 is worth
    v = torch.where(step[..., None] > 0, groups / step[..., None], 0.0).flatten(-2)  # [..., R, C]
    code = torch.bucketize(v.abs().clamp_(max=6.0), MIDPOINTS) | ((v < 0).long() << 3)
    pairs = code.to(torch.uint8).unflatten(-1, (-1, 2))  # [..., R, C/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4), scale, scale_2
