"""One task of the CPU MoE pool's row-block path (compute modes float32 / native, and work run
inline): an expert FFN restricted to a block of its I rows. The pool's default path is the
layer kernel (ft.engine.cpu.layer); ExpertJob and the part checks here serve both.

FFN(x) = down(silu(x @ gate.T) * (x @ up.T)) splits exactly over blocks of I: the blocks' partial
outputs add up to the whole. Compute modes: "float32" (blocks converted to a per-worker fp32
scratch, exact; for CPUs without bf16 dot products), "native" (the weights' dtype, fp32
accumulation), "compiled" (the format's numba kernels straight on the expert's bytes, the GIL
released once a task; quantised formats always). "auto" takes compiled for bf16 (one call a
task: on 15 threads a chain of torch ops contends for the GIL at each op, ~2x slower), native
where the CPU has the dtype's dot products in hardware, float32 elsewhere. Whole fp32 copies of
the store are not kept: host memory holds every expert in the offload regime.
Legend: n = tokens routed to the expert, D = hidden, I = expert intermediate, s = rows of I.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from ft import cpuinfo
from ft.engine.formats import ExpertFormat, get_format

COMPUTE_MODES = ("auto", "float32", "native", "compiled")
COMPILED_FLOATS = (torch.bfloat16, torch.float32)  # unquantised weights the kernels read
_HW_DOT = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


@dataclass(frozen=True)
class ExpertJob:
    """One expert's work in a layer: the tokens `rows` of x routed to it, with their weights."""

    parts: dict[str, torch.Tensor]  # the expert's parts, host (bf16: w13 [2I, D], w2 [D, I])
    rows: torch.Tensor  # [n] long, indices into x
    weights: torch.Tensor  # [n] router weights
    fmt: str = "bf16"  # expert format of `parts` (ft.engine.formats)

    @property
    def inter(self) -> int:
        return self.parts["w13"].shape[0] // 2  # I: w13 has 2I rows in every format


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
    compiled: bool  # multiplied by the format's compiled kernels (rows_dot), x in float32
    # bf16 weights, compiled: the whole block in one kernel call (cpu_kernels.bf16_ffn_block:
    # its numpy operands, made once per job); None: the other paths
    fused: tuple | None = None


def expert_jobs(
    bank: dict[str, torch.Tensor], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    experts: list[int], fmt: str = "bf16",
) -> list[ExpertJob]:  # fmt: skip
    """One ExpertJob per expert in `experts`, from a layer's routing (all on the CPU).

    `bank` is the layer's host store (part -> [E, ...], format `fmt`); topk_ids /
    topk_weights [T, K].
    """
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
    compiled = uses_kernels(mode, form, weight_dtype)
    compute = torch.float32 if compiled else choose_compute(mode, weight_dtype)
    direct = not compiled and not form.quantized and weight_dtype == compute
    xj = x.index_select(0, job.rows).to(compute)  # [n, D]
    scale = job.weights.to(compute)[:, None]  # [n, 1]
    dense = x.shape[0] == 1
    fused = None
    if compiled and weight_dtype == torch.bfloat16 and not form.quantized:
        check_parts(form, job.parts, x.shape[1], job.inter)  # the kernel does not check bounds
        bits = [job.parts[k].view(torch.int16).numpy().view(np.uint16) for k in ("w13", "w2")]
        fused = (xj.numpy(), *bits, job.inter, scale[:, 0].contiguous().numpy(), job.rows.numpy())
    return [
        Slice(job, xj, scale, lo, hi, compute, lo == 0, dense, form, direct, compiled, fused)
        for lo, hi in blocks
    ]


def uses_kernels(mode: str, form: ExpertFormat, weight_dtype: torch.dtype) -> bool:
    """Whether blocks go to the format's compiled kernels: always for quantised formats (they
    have no other path); for bf16 weights unless another mode is asked (the module's note);
    for float32 weights when asked. `ft bench bw`'s isa_sweep measures the modes on a box."""
    if form.quantized:
        return True
    auto_bf16 = mode == "auto" and weight_dtype == torch.bfloat16
    return auto_bf16 or (mode == "compiled" and weight_dtype in COMPILED_FLOATS)


@cache
def choose_compute(mode: str, weight_dtype: torch.dtype) -> torch.dtype:
    if mode not in COMPUTE_MODES:
        raise ValueError(f"CPU MoE compute must be one of {COMPUTE_MODES}, got {mode!r}")
    if weight_dtype == torch.float32 or mode == "native":
        return weight_dtype
    if mode == "auto" and _HW_DOT.get(weight_dtype, set()) & cpuinfo.isa_flags():
        return weight_dtype
    return torch.float32


def describe_compute(mode: str, form: ExpertFormat, weight_dtype: torch.dtype) -> str:
    """For log lines and the profile: 'compiled float32', 'float32' or 'native bfloat16'."""
    if uses_kernels(mode, form, weight_dtype):
        return "compiled float32"
    dtype = choose_compute(mode, weight_dtype)
    return "float32" if dtype == torch.float32 else f"native {str(dtype).removeprefix('torch.')}"


def run_slice(sl: Slice, acc: torch.Tensor, scratch: dict) -> None:
    """acc[rows] += weights * (the block's share of FFN(x[rows])); acc is [T, D] float32."""
    if sl.fused is not None:  # one call: the GIL released once for the whole block
        from ft.engine.cpu import kernels as cpu_kernels

        x, w13, w2, inter, scale, rows = sl.fused
        cpu_kernels.bf16_ffn_block(x, w13, w2, sl.lo, sl.hi, inter, scale, rows, acc.numpy())
        return
    if sl.compiled:
        _add(sl, acc, _compiled_block(sl))
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


def _compiled_block(sl: Slice) -> torch.Tensor:
    """The block's share [n, D] float32, from the expert's codes or weights by the format's
    compiled CPU kernels (GIL released: no dequantised copy of the block)."""
    parts, form, inter = sl.job.parts, sl.form, sl.job.inter
    x = sl.x.numpy()  # [n, D] float32 (make_slices)
    n, hidden, s = x.shape[0], x.shape[1], sl.hi - sl.lo
    check_parts(form, parts, hidden, inter)  # the kernels do not check their bounds
    gate, up = np.empty((n, s), np.float32), np.empty((n, s), np.float32)
    form.rows_dot(parts, "w13", sl.lo, sl.hi, 0, x, gate)
    form.rows_dot(parts, "w13", inter + sl.lo, inter + sl.hi, 0, x, up)
    act = F.silu(torch.from_numpy(gate)).mul_(torch.from_numpy(up)).mul_(sl.scale)  # [n, s]
    out = np.empty((n, hidden), np.float32)
    form.rows_dot(parts, "w2", 0, hidden, sl.lo, act.numpy(), out)  # columns lo..hi of w2
    return torch.from_numpy(out)


def check_parts(form: ExpertFormat, parts: dict, hidden: int, inter: int) -> None:
    """ValueError naming a part whose shape or dtype is not the format's for (D, I): the
    compiled kernels read raw memory and check no bounds."""
    want = _expected_parts(form, hidden, inter, parts["w13"].dtype)
    for name, (shape, dtype) in want.items():
        got = parts.get(name)
        if got is None or tuple(got.shape) != shape or got.dtype != dtype:
            found = None if got is None else (tuple(got.shape), got.dtype)
            raise ValueError(f"{form.name} expert part {name}: want {shape} {dtype}, got {found}")


@cache
def _expected_parts(form: ExpertFormat, hidden: int, inter: int, dtype: torch.dtype) -> dict:
    return {k: (p.shape, p.dtype) for k, p in form.parts(hidden, inter, dtype).items()}


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
