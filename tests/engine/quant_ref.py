"""Plain-torch quantise / dequantise of expert banks per the formats contract (issue 8), for
kernel tests: float banks in, contract banks out, and back to float32 for the reference FFN.
Runs on any device. Independent of ft's own format code on purpose (a second reading of the
contract).

Legend: N = slots, D = hidden, I = expert intermediate, R/C = rows/columns of one matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = ("bf16", "int8", "fp8_block", "nvfp4")
BLOCK = 128  # fp8_block's square block
GROUP = 16  # nvfp4's elements per e4m3 scale
Q8_BLOCK = 32  # activation elements per scale in q8_0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code & 7
E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # round-to-nearest thresholds


def quantize(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """w13 [N, 2I, D], w2 [N, D, I] float -> the format's bank (parts with leading dim N)."""
    if fmt == "bf16":
        return {"w13": w13, "w2": w2}
    inter = w13.shape[1] // 2
    halves = {"w13": (w13[:, :inter], w13[:, inter:]), "w2": (w2,)}
    bank = {}
    for name, mats in halves.items():
        parts = [QUANTIZERS[fmt](m.float()) for m in mats]  # per tensor half (gate, up)
        for suffix, *tensors in zip(("", "_scale", "_scale_2"), *parts, strict=False):
            bank[name + suffix] = torch.cat(tensors, dim=1)  # gate's rows, then up's
    return bank


def dequantize(bank: dict[str, torch.Tensor], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (w13 [N, 2I, D], w2 [N, D, I]) float32."""
    if fmt == "bf16":
        return bank["w13"].float(), bank["w2"].float()
    inter = bank["w13"].shape[1] // 2
    w13 = torch.cat([_half(bank, "w13", fmt, g, inter) for g in (0, 1)], dim=1)
    return w13, _half(bank, "w2", fmt, 0, bank["w2"].shape[1])


def _half(bank, name: str, fmt: str, g: int, rows: int) -> torch.Tensor:
    """Tensor half g (gate 0, up 1) of weight `name`, rows [g * rows, (g + 1) * rows), float32."""
    q, scale = bank[name][:, g * rows : (g + 1) * rows], bank[name + "_scale"]
    if fmt == "int8":
        return q.float() * scale[:, g * rows : (g + 1) * rows, None]
    if fmt == "fp8_block":
        nbr = -(-rows // BLOCK)  # block rows per half
        return q.float() * _expand(scale[:, g * nbr : (g + 1) * nbr], *q.shape[1:])
    codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).long()  # [N, R, C] low nibble first
    grid = torch.tensor(E2M1, device=q.device)
    value = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    group = scale[:, g * rows : (g + 1) * rows].float().repeat_interleave(GROUP, dim=-1)
    return value * group * bank[name + "_scale_2"][:, g, None, None]


def q8_0(v: torch.Tensor) -> torch.Tensor:
    """v [..., C] rounded as llama.cpp's Q8_0 activations (the CPU pool's integer dot for int8
    experts): per block of 32 along C, round(v / d) * d, d = amax(block) / 127."""
    c = v.shape[-1]
    blocks = F.pad(v.float(), (0, -c % Q8_BLOCK)).unflatten(-1, (-1, Q8_BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.where(d > 0, torch.round(blocks / d) * d, 0.0).flatten(-2)[..., :c]


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, R, C] -> q int8 [N, R, C], scale float32 [N, R]: symmetric per output row."""
    scale = w.abs().amax(-1).clamp(min=1e-12) / 127
    return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, R, C] -> q e4m3 [N, R, C], scale float32 [N, ceil(R/128), ceil(C/128)]."""
    n, r, c = w.shape
    padded = F.pad(w, (0, -c % BLOCK, 0, -r % BLOCK))
    tiles = padded.unflatten(2, (-1, BLOCK)).unflatten(1, (-1, BLOCK))  # [N, BR, 128, BC, 128]
    scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448
    return (w / _expand(scale, r, c)).to(torch.float8_e4m3fn), scale


def nvfp4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, R, C] (one global scale per N) -> packed codes uint8 [N, R, C/2], e4m3 scale
    [N, R, C/16], scale_2 float32 [N, 1] (ModelOpt's recipe, as in the contract)."""
    scale_2 = w.abs().amax(dim=(1, 2)).clamp(min=1e-12) / (6 * 448)  # [N]
    groups = w.unflatten(2, (-1, GROUP))  # [N, R, C/16, 16]
    scale = (groups.abs().amax(-1) / 6 / scale_2[:, None, None]).to(torch.float8_e4m3fn)
    denom = scale.float()[..., None] * scale_2[:, None, None, None]
    scaled = torch.where(denom > 0, groups / denom, 0.0).flatten(2)  # [N, R, C]
    mids = torch.tensor(E2M1_MIDS, device=w.device)
    codes = torch.bucketize(scaled.abs(), mids) | (scaled < 0).long() << 3
    packed = codes[..., 0::2] | codes[..., 1::2] << 4  # element 2j low, 2j + 1 high
    return packed.to(torch.uint8), scale, scale_2[:, None]


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [N, BR, BC] -> one per element [N, rows, cols]."""
    full = scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return full[:, :rows, :cols]


QUANTIZERS = {"int8": int8_rows, "fp8_block": fp8_blocks, "nvfp4": nvfp4_groups}


# -- the CPU pool's integer dot (int8 experts of few tokens, nvfp4's of one) and bf16 dot -----


def bf16_round(v: torch.Tensor) -> torch.Tensor:
    """v rounded to bf16 (to nearest, ties to even), in float32: the activations of the CPU
    pool's bf16 dot."""
    return v.float().to(torch.bfloat16).float()


def moe_reference(x, w13, w2, topk_ids, topk_weights, int_dot_tokens: int = 0,
                  bf16_dot: bool = False) -> torch.Tensor:  # fmt: skip
    """float32: every token through each of its experts, one at a time (w13 [N, 2I, D], w2
    [N, D, I] float32). An expert with at most int_dot_tokens tokens in the call has its x and
    act rounded as the pool's integer dot rounds them (q8_0); bf16_dot: every other expert has
    them rounded as the pool's bf16 dot does (bf16_round)."""
    out, inter = torch.zeros(x.shape), w2.shape[2]
    counts = torch.bincount(topk_ids.flatten(), minlength=w13.shape[0])
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist(), strict=True):
            rnd = lambda v: v  # noqa: E731
            if counts[e] <= int_dot_tokens:
                rnd = q8_0
            elif bf16_dot:
                rnd = bf16_round
            xt = rnd(x[t])
            act = w * F.silu(w13[e, :inter] @ xt) * (w13[e, inter:] @ xt)
            out[t] += w2[e] @ rnd(act)
    return out


def act_flip(x, w13, w2, topk_ids, topk_weights) -> float:
    """How far one act element rounded to the other side of a half-step (kernel and torch
    compute act in float32 in different orders) can move an output of the integer or bf16 dot:
    one step, amax(act) / 127 (bf16's is at most amax / 128), times max |w2|; the largest over
    the experts."""
    inter, flip = w2.shape[2], 0.0
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist(), strict=True):
            xt = q8_0(x[t])
            act = w * F.silu(w13[e, :inter] @ xt) * (w13[e, inter:] @ xt)
            flip = max(flip, act.abs().max().item() / 127 * w2[e].abs().max().item())
    return flip
