"""`fp8_block`: float8 e4m3 weights with one float32 scale per 128 x 128 block, as DeepSeek-V3
and Qwen3-FP8 checkpoints store them (weight-only here: activations stay float).

w[r, c] = float(q[r, c]) * scale[r // 128, c // 128], scale = amax(block) / 448. Gate and up are
blocked apart (each is its own checkpoint tensor), so w13's block row of row r is
(r // I) * ceil(I / 128) + (r % I) // 128. Parts: w13 e4m3 [2I, D], w13_scale float32
[2 ceil(I/128), ceil(D/128)], w2 e4m3 [D, I], w2_scale float32 [ceil(D/128), ceil(I/128)].
Checkpoint: `{proj}.weight` e4m3 [R, C], `{proj}.weight_scale_inv` float32 [ceil(R/128),
ceil(C/128)] (the name says inverse; it multiplies, as in those checkpoints).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ft.engine.formats.base import (
    E4M3,
    E4M3_TABLE,
    E4M3_VALUES,
    ExpertFormat,
    Part,
    Parts,
    ceil_div,
    code_table,
    decode_into,
)

BLOCK = 128
E4M3_MAX = 448.0


class Fp8BlockFormat(ExpertFormat):
    name = "fp8_block"
    tensors = {"weight": "", "weight_scale_inv": "_scale"}

    def parts(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, Part]:
        bd, bi = ceil_div(hidden, BLOCK), ceil_div(inter, BLOCK)
        return {
            "w13": Part((2 * inter, hidden), E4M3),
            "w13_scale": Part((2 * bi, bd), torch.float32),
            "w2": Part((hidden, inter), E4M3),
            "w2_scale": Part((bd, bi), torch.float32),
        }

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Parts:
        inter = w13.shape[-2] // 2
        qg, sg = quantize_blocks(w13[..., :inter, :])
        qu, su = quantize_blocks(w13[..., inter:, :])
        q2, s2 = quantize_blocks(w2)
        return {"w13": torch.cat((qg, qu), -2), "w13_scale": torch.cat((sg, su), -2),
                "w2": q2, "w2_scale": s2}  # fmt: skip

    def w13_rows(self, parts: Parts, r0: int, r1: int, out: torch.Tensor) -> None:
        block_rows = _w13_scale_rows(torch.arange(r0, r1), self.inter_of(parts))
        _decode(parts["w13"][..., r0:r1, :], out)
        scale_cols(out, parts["w13_scale"][..., block_rows, :], 0)

    def w2_cols(self, parts: Parts, c0: int, c1: int, out: torch.Tensor) -> None:
        block_rows = torch.arange(parts["w2"].shape[-2]) // BLOCK
        _decode(parts["w2"][..., c0:c1], out)
        scale_cols(out, parts["w2_scale"][..., block_rows, :], c0)

    def rows_dot(self, parts: Parts, name: str, r0: int, r1: int, c0: int, x, out) -> None:
        from ft.engine.cpu import kernels as cpu_kernels  # numba: imported where it is used

        rows = np.arange(r0, r1)
        if name == "w13":
            scale_row = _w13_scale_rows(rows, self.inter_of(parts))
        else:
            scale_row = rows // BLOCK
        codes = parts[name].view(torch.uint8).numpy()
        scales = parts[f"{name}_scale"].numpy()
        cpu_kernels.table_rows(x, codes, E4M3_TABLE, r0, r1, c0, scales, scale_row, BLOCK, out)

    def checkpoint_shape(self, suffix: str, rows: int, cols: int) -> tuple[int, ...]:
        if suffix == "weight_scale_inv":
            return (ceil_div(rows, BLOCK), ceil_div(cols, BLOCK))
        return (rows, cols)

    def quantization_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": ["lm_head", "self_attn", "mlp.gate"]}  # fmt: skip

    def matches(self, config: dict | None) -> bool:
        return (
            bool(config)
            and config.get("quant_method") == "fp8"
            and config.get("fmt", "e4m3") == "e4m3"
            and list(config.get("weight_block_size") or []) == [BLOCK, BLOCK]
        )


def _w13_scale_rows(rows, inter: int):
    """The w13_scale row of each w13 row (torch or numpy ints): gate's blocks of rows, then up's."""
    return (rows // inter) * ceil_div(inter, BLOCK) + (rows % inter) // BLOCK


def _decode(q: torch.Tensor, out: torch.Tensor) -> None:
    """out = float(q), exact in any float dtype (e4m3 fits bf16)."""
    decode_into(code_table(E4M3_VALUES, out.dtype), q.view(torch.uint8), out)


def scale_cols(out: torch.Tensor, scale: torch.Tensor, c0: int) -> None:
    """out [..., n, s] (columns c0.. of a tensor) *= the block scale of each column, from
    scale [..., n, column blocks]. Whole blocks multiply through a view; others gather. The
    scales are cast to out's dtype first (a mixed-dtype multiply is many times slower)."""
    s, scale = out.shape[-1], scale.to(out.dtype)
    if c0 % BLOCK == 0 and s % BLOCK == 0:  # the real shapes (D, I multiples of 128)
        picked = scale[..., c0 // BLOCK : (c0 + s) // BLOCK, None]  # [..., n, s/128, 1]
        out.view(*out.shape[:-1], s // BLOCK, BLOCK).mul_(picked)
    else:
        out.mul_(scale[..., torch.arange(c0, c0 + s) // BLOCK])  # [..., n, s]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] float -> (q e4m3 [..., R, C], scale float32 [..., ceil(R/128),
    ceil(C/128)])."""
    rows, cols = w.shape[-2:]
    rb, cb = ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)
    padded = F.pad(w.float(), (0, cb * BLOCK - cols, 0, rb * BLOCK - rows))  # zeros: no effect
    blocks = padded.unflatten(-1, (cb, BLOCK)).unflatten(-3, (rb, BLOCK))  # [..., rb, B, cb, B]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rb, cb]
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (blocks / scale[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols]  # back to [..., R, C]
    return q.to(E4M3).contiguous(), scale
