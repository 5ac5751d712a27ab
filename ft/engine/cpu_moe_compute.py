"""One task of the CPU MoE executor: an expert FFN restricted to a block of its I rows.

FFN(x) = down(silu(x @ gate.T) * (x @ up.T)) splits exactly over blocks of I: the partial
outputs of the blocks add up to the whole. Shape legend: n = tokens routed to the expert,
D = hidden, I = expert intermediate, s = rows of I in this block.

Compute dtype. "float32" converts each block of bf16/fp16 weights into a per-worker fp32
scratch buffer (it stays in L2) and multiplies in fp32: exact against an fp32 reference, and the
fast path on CPUs without bf16 dot-product instructions, where torch's bf16 matrix-vector path
is bound by arithmetic (DESIGN.md section 6). Whole fp32 copies of the store are not kept: they
would double host memory exactly where host memory holds every expert (the offload regime).
"native" multiplies in the weights' own dtype and accumulates the outputs in fp32; measured on
an AVX-512-BF16/AMX Xeon (one thread, H=2048, I=768, batch 1, blocks of 384 rows) it computes
5.0 GB/s of expert bytes against 3.2 for the fp32 conversion. "auto" picks native where the CPU
has bf16 dot products in hardware, float32 elsewhere.

Quantised experts (int8, fp8_block, nvfp4) are multiplied straight from their codes by the
format's compiled CPU kernels (ExpertFormat.rows_dot, ft/engine/formats/cpu_kernels.py), in
float32 whatever the mode, with the GIL released: no dequantised copy of the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ft import cpuinfo
from ft.engine.formats import ExpertFormat, get_format

if TYPE_CHECKING:
    from ft.engine.cpu_moe import ExpertJob

COMPUTE_MODES = ("auto", "float32", "native")
_HW_DOT = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


@dataclass(frozen=True)
class Slice:
    job: ExpertJob
    x: torch.Tensor  # [n, D] the job's tokens, already in the compute dtype
    scale: torch.Tensor  # [n, 1] the job's router weights, in the compute dtype
    lo: int  # block [lo, hi) of I
    hi: int
    compute: torch.dtype
    first: bool  # the block that counts the expert once in the stats
    dense: bool  # x has one row, so rows == [0]: a plain add instead of index_add
    form: ExpertFormat  # the job's expert format
    direct: bool  # bf16 parts already in the compute dtype: multiplied in place, no copy


def expert_jobs(
    bank: dict[str, torch.Tensor], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    experts: list[int], fmt: str = "bf16",
) -> list[ExpertJob]:  # fmt: skip
    """One ExpertJob per expert in `experts`, from a layer's routing (all on the CPU).

    `bank` is the layer's host store (part -> [E, ...], format `fmt`); topk_ids /
    topk_weights [T, K].
    """
    from ft.engine.cpu_moe import ExpertJob

    jobs = []
    for e in experts:
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)  # [n], [n]
        if tokens.numel():
            weights = topk_weights[tokens, slots].float()  # [n]
            parts = {name: t[e] for name, t in bank.items()}
            jobs.append(ExpertJob(parts=parts, rows=tokens, weights=weights, fmt=fmt))
    return jobs


def make_slices(
    job: ExpertJob, x: torch.Tensor, mode: str, blocks: list[tuple[int, int]]
) -> list[Slice]:
    """The job's blocks, sharing its gathered tokens and weights (made once, on the caller)."""
    form = get_format(job.fmt)
    weight_dtype = job.parts["w13"].dtype
    # quantised: the format's kernels multiply its codes in float32, whatever `mode` says
    compute = torch.float32 if form.quantized else choose_compute(mode, weight_dtype)
    direct = not form.quantized and weight_dtype == compute
    xj = x.index_select(0, job.rows).to(compute)  # [n, D]
    scale = job.weights.to(compute)[:, None]  # [n, 1]
    dense = x.shape[0] == 1
    return [
        Slice(job, xj, scale, lo, hi, compute, lo == 0, dense, form, direct) for lo, hi in blocks
    ]


@cache
def choose_compute(mode: str, weight_dtype: torch.dtype) -> torch.dtype:
    if mode not in COMPUTE_MODES:
        raise ValueError(f"CPU MoE compute must be one of {COMPUTE_MODES}, got {mode!r}")
    if weight_dtype == torch.float32 or mode == "native":
        return weight_dtype
    if mode == "auto" and _HW_DOT.get(weight_dtype, set()) & cpuinfo.isa_flags():
        return weight_dtype
    return torch.float32


def describe_compute(mode: str, weight_dtype: torch.dtype) -> str:
    """For log lines and the profile: 'float32' or 'native bf16'."""
    dtype = choose_compute(mode, weight_dtype)
    return "float32" if dtype == torch.float32 else f"native {str(dtype).removeprefix('torch.')}"


def run_slice(sl: Slice, acc: torch.Tensor, scratch: dict) -> None:
    """acc[rows] += weights * (the block's share of FFN(x[rows])); acc is [T, D] float32."""
    if sl.form.quantized:
        _add(sl, acc, _quantized_block(sl))
        return
    parts, s, hidden = sl.job.parts, sl.hi - sl.lo, sl.x.shape[1]
    if sl.direct:
        w13, w2, inter = parts["w13"], parts["w2"], sl.job.inter
        gate = sl.x @ w13[sl.lo : sl.hi].T  # [n, s]
        up = sl.x @ w13[inter + sl.lo : inter + sl.hi].T  # [n, s]
        down = w2[:, sl.lo : sl.hi]  # [D, s]
    else:  # convert / dequantise this block only, into buffers that stay in cache
        gu = _buffer(scratch, "gu", (2 * s, hidden), sl.compute)  # [2s, D]: gate rows, up rows
        down = _buffer(scratch, "down", (hidden, s), sl.compute)  # [D, s]
        sl.form.dequant_block(parts, sl.lo, sl.hi, gu, down)
        h = sl.x @ gu.T  # [n, 2s]
        gate, up = h[:, :s], h[:, s:]
    act = F.silu(gate).mul_(up).mul_(sl.scale)  # [n, s]
    _add(sl, acc, (act @ down.T).float())


def _quantized_block(sl: Slice) -> torch.Tensor:
    """The block's share [n, D] float32, from the expert's codes by the format's CPU kernels
    (compiled, GIL released: no dequantised copy of the block)."""
    parts, form, inter = sl.job.parts, sl.form, sl.job.inter
    x = sl.x.numpy()  # [n, D] float32 (make_slices)
    n, hidden, s = x.shape[0], x.shape[1], sl.hi - sl.lo
    gate, up = np.empty((n, s), np.float32), np.empty((n, s), np.float32)
    form.rows_dot(parts, "w13", sl.lo, sl.hi, 0, x, gate)
    form.rows_dot(parts, "w13", inter + sl.lo, inter + sl.hi, 0, x, up)
    act = F.silu(torch.from_numpy(gate)).mul_(torch.from_numpy(up)).mul_(sl.scale)  # [n, s]
    out = np.empty((n, hidden), np.float32)
    form.rows_dot(parts, "w2", 0, hidden, sl.lo, act.numpy(), out)  # columns lo..hi of w2
    return torch.from_numpy(out)


def _add(sl: Slice, acc: torch.Tensor, out: torch.Tensor) -> None:
    if sl.dense:
        acc.add_(out)
    else:
        acc.index_add_(0, sl.job.rows, out)  # into [T, D]


def _buffer(scratch: dict, key: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A view of a per-worker buffer, grown only when a larger block comes."""
    need = shape[0] * shape[1]
    buf = scratch.get((key, dtype))
    if buf is None or buf.numel() < need:
        buf = scratch[(key, dtype)] = torch.empty(need, dtype=dtype)
    return buf[:need].view(shape)
