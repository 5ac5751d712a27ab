"""The caller's side of the pool's layer call: a layer's CPU share (k experts, their tokens)
becomes one plan of int64 words that the workers, waiting in compiled code, run at once
(ft.engine.cpu.layer_kernel says how the work is split). One call is in flight at a time; a second
submit first waits for the first.

Python runs once per call, on the caller: the plan (the parts' addresses, the tokens), checked
here, because the kernel reads raw addresses and checks no bounds.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from ft.engine.cpu import layer_kernel as K
from ft.engine.cpu.compute import ExpertJob, check_parts
from ft.engine.cpu.sync import control_block
from ft.engine.formats import get_format

# (format name, weight dtype) -> the kernel's format and the parts in the plan's order
_KERNEL_FORMATS = {
    ("bf16", torch.bfloat16): (K.BF16, ("w13", "w2")),
    ("bf16", torch.float32): (K.F32, ("w13", "w2")),
    ("int8", torch.int8): (K.INT8, ("w13", "w2", "w13_scale", "w2_scale")),
    ("fp8_block", torch.float8_e4m3fn): (K.FP8, ("w13", "w2", "w13_scale", "w2_scale")),
    ("nvfp4", torch.uint8): (
        K.NVFP4,
        ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"),
    ),
}


def kernel_format(fmt: str, weight_dtype: torch.dtype) -> tuple[int, tuple[str, ...]] | None:
    """The layer kernel's format for experts of `fmt` whose w13 is `weight_dtype` (None: it reads
    no such experts, e.g. fp16 weights; the pool runs those on the caller, counted and warned)."""
    return _KERNEL_FORMATS.get((fmt, weight_dtype))


def q8_0(v: torch.Tensor) -> torch.Tensor:
    """v [..., C] float32 as the kernel rounds an integer-dot expert's activations (x, and act
    before the down projection): per block of 32 along C, rint(v / d) * d, d = amax / 127
    (llama.cpp's Q8_0; layer_kernel._quantize_q8). For references that model the rounding."""
    c = v.shape[-1]
    blocks = F.pad(v.float(), (0, -c % K.Q8_BLOCK)).unflatten(-1, (-1, K.Q8_BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.where(d > 0, torch.round(blocks / d) * d, 0.0).flatten(-2)[..., :c]


def bf16_round(v: torch.Tensor) -> torch.Tensor:
    """v float32 as the kernel rounds a bf16-dot expert's activations: to bf16 (to nearest, ties
    to even: layer_kernel._to_bf16), back in float32. For references that model the rounding."""
    return v.float().to(torch.bfloat16).float()


def act_rounding(fmt: str, weight_dtype: torch.dtype, tokens: int):
    """How the kernel rounds the activations of an expert of `fmt` (stored as `weight_dtype`)
    with `tokens` tokens in a call: q8_0 where it takes the integer dot (int8, or nvfp4 on AVX2,
    few tokens), bf16_round where it takes the bf16 dot (bf16 on AVX512-BF16), None where they
    stay float32."""
    code = kernel_format(fmt, weight_dtype)
    if code is None:
        return None
    if K.integer_dot.py_func(code[0], tokens):  # the kernel's tests
        return q8_0
    return bf16_round if K.bf16_dotted.py_func(code[0]) else None


class LayerHandle:
    """One submitted call; wait() returns [T, D] float32 (the sum over its experts)."""

    def __init__(self, calls: LayerCalls, gen: int, out: torch.Tensor, keep: tuple) -> None:
        self._calls, self.gen, self._out = calls, gen, out
        self._keep = keep  # what the workers read by address: alive until the call is done
        self._finished = False
        self.ran_on: set[str] = set()

    def done(self) -> bool:
        return self._finished or self._calls.finished(self.gen)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Blocks until the workers are done (the GIL released). `timeout` is the task path's
        argument and is not used here: the workers run compiled code that cannot raise (submit
        checked the plan), so every call ends once each worker has run its share."""
        if not self._finished:
            self._calls.wait(self.gen)
            self._finished, self._keep = True, ()
            self.ran_on = set(self._calls.names)
        return self._out


class LayerCalls:
    """The control block the workers wait on, and the plans sent through it."""

    def __init__(self, workers: int, names: list[str]) -> None:
        self.workers, self.names = workers, names
        K.compile_all()
        self.ctrl = control_block(K.CONTROL_WORDS)
        self._gen = 0
        self._last: LayerHandle | None = None
        self._lock = threading.Lock()  # submits from two threads publish one after the other

    def serve(self, worker: int) -> None:
        """The worker thread's whole life (returns on stop)."""
        K.serve(self.ctrl, worker)

    def reads(self, fmt: str, weight_dtype: torch.dtype) -> bool:
        """Whether the kernel reads experts of `fmt` stored as `weight_dtype`."""
        return kernel_format(fmt, weight_dtype) is not None

    def stop(self) -> None:
        with self._lock:
            if self._last is not None:
                self._last.wait()
            self._gen += 1
            K.stop(self.ctrl, self._gen)

    def finished(self, gen: int) -> bool:
        return int(self.ctrl[K.DONE]) >= gen * self.workers

    def wait(self, gen: int) -> None:
        K.wait_done(self.ctrl, gen, self.workers)

    def submit(self, x: torch.Tensor, jobs: list[ExpertJob]) -> LayerHandle:
        """Publish the jobs (all of one format, weights on the host) as one call."""
        plan, keep, out = build_plan(x, jobs, self.workers)
        with self._lock:
            if self._last is not None:
                self._last.wait()  # one call in flight: the workers share one control block
            self._gen += 1
            handle = LayerHandle(self, self._gen, out, (plan, *keep))
            K.start_call(self.ctrl, plan.ctypes.data, self._gen)
            self._last = handle
        return handle


def build_plan(x: torch.Tensor, jobs: list[ExpertJob], workers: int):
    """-> (plan words, arrays it points at, out [T, D]); ValueError for what the kernel cannot
    read safely (a part of the wrong shape, dtype or layout, mixed formats)."""
    first = jobs[0]
    fmt, weight_dtype, inter = first.fmt, first.parts["w13"].dtype, first.inter
    code_parts = kernel_format(fmt, weight_dtype)
    if code_parts is None:
        raise ValueError(f"no layer kernel for {fmt} experts of {weight_dtype}")
    code, names = code_parts
    tokens, hidden = x.shape
    form = get_format(fmt)
    plan = np.zeros(K.HEADER + len(jobs) * K.PARTS, np.int64)
    for e, job in enumerate(jobs):
        if job.fmt != fmt:
            raise ValueError(f"one layer call holds one expert format: {fmt} and {job.fmt}")
        check_parts(form, job.parts, hidden, inter)
        base = K.HEADER + e * K.PARTS
        for p, name in enumerate(names):
            if not job.parts[name].is_contiguous():  # the kernel walks rows by address
                raise ValueError(f"{fmt} expert part {name} is not contiguous")
            plan[base + p] = job.parts[name].data_ptr()
    counts = [job.rows.numel() for job in jobs]
    starts = np.zeros(len(jobs) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    rows = torch.cat([job.rows for job in jobs]).to(torch.int64).numpy()
    if rows.size and (rows.min() < 0 or rows.max() >= tokens):
        raise ValueError(f"token rows must lie in [0, {tokens})")
    weights = torch.cat([job.weights for job in jobs]).to(torch.float32).numpy()
    xs = x.to(torch.float32).contiguous().numpy()
    act = np.empty((max(int(starts[-1]), 1), inter), np.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    plan[: K.TOKEN_WEIGHT + 1] = (
        code, len(jobs), tokens, hidden, inter, workers, xs.ctypes.data, act.ctypes.data,
        out.data_ptr(), starts.ctypes.data, rows.ctypes.data, weights.ctypes.data,
    )  # fmt: skip
    return plan, (xs, act, starts, rows, weights, [job.parts for job in jobs]), out
