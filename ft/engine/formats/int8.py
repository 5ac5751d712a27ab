"""`int8`: per-output-channel symmetric int8 weights, weight-only (activations stay float).

w = q * scale[row], scale = amax(row) / 127, q = round(w / scale) in [-127, 127]. Parts: w13 int8
[2I, D], w13_scale float32 [2I], w2 int8 [D, I], w2_scale float32 [D].

Checkpoint (compressed-tensors "int-quantized", as llm-compressor writes W8A16 channel-wise):
`{proj}.weight` int8 [R, C] and `{proj}.weight_scale` float32 [R, 1]; config.json names the
routed experts as the only targets, so every other Linear stays float.
"""

from __future__ import annotations

import torch

from ft.engine.formats.base import ExpertFormat, Part, Parts

QMAX = 127
EXPERT_TARGETS = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]


class Int8Format(ExpertFormat):
    name = "int8"
    tensors = {"weight": "", "weight_scale": "_scale"}

    def parts(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, Part]:
        return {
            "w13": Part((2 * inter, hidden), torch.int8),
            "w13_scale": Part((2 * inter,), torch.float32),
            "w2": Part((hidden, inter), torch.int8),
            "w2_scale": Part((hidden,), torch.float32),
        }

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Parts:
        q13, s13 = quantize_rows(w13)
        q2, s2 = quantize_rows(w2)
        return {"w13": q13, "w13_scale": s13, "w2": q2, "w2_scale": s2}

    def w13_rows(self, parts: Parts, r0: int, r1: int, out: torch.Tensor) -> None:
        _dequant(parts["w13"][..., r0:r1, :], parts["w13_scale"][..., r0:r1, None], out)

    def w2_cols(self, parts: Parts, c0: int, c1: int, out: torch.Tensor) -> None:
        _dequant(parts["w2"][..., c0:c1], parts["w2_scale"][..., :, None], out)

    def rows_dot(self, parts: Parts, name: str, r0: int, r1: int, c0: int, x, out) -> None:
        from ft.engine.cpu import kernels as cpu_kernels  # numba: imported where it is used

        row_scale = parts[f"{name}_scale"][r0:r1].numpy()
        cpu_kernels.int8_rows(x, parts[name].numpy(), r0, r1, c0, row_scale, out)

    def checkpoint_shape(self, suffix: str, rows: int, cols: int) -> tuple[int, ...]:
        return (rows, 1) if suffix == "weight_scale" else (rows, cols)

    def quantization_config(self) -> dict:
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                   "dynamic": False}  # fmt: skip
        group = {"targets": EXPERT_TARGETS, "weights": weights, "input_activations": None,
                 "output_activations": None}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": group},
                "ignore": []}  # fmt: skip

    def matches(self, config: dict | None) -> bool:
        if not config or config.get("quant_method") != "compressed-tensors":
            return False
        want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        groups = (config.get("config_groups") or {}).values()
        return any(
            all((g.get("weights") or {}).get(k) == v for k, v in want.items()) for g in groups
        )


def _dequant(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out = q * scale: the codes are exact in any float dtype; the multiply runs in out's
    dtype (a mixed int8 x float32 -> bf16 multiply is several times slower on the CPU)."""
    out.copy_(q).mul_(scale.to(out.dtype))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] float -> (q int8 [..., R, C], scale float32 [..., R])."""
    w = w.float()
    amax = w.abs().amax(-1)  # [..., R]
    scale = torch.where(amax > 0, amax / QMAX, 1.0)  # an all-zero row keeps a harmless 1
    q = torch.round(w / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale
