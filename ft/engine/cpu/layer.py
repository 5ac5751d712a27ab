"""The caller's side of the pool's layer call: a layer's CPU share (k experts, their tokens)
becomes one plan of int64 words that the workers, waiting in compiled code, run at once
(ft.engine.cpu.layer_kernel says how the work is split). One call is in flight at a time; a second
submit first waits for the first.

Python runs once per call, on the caller: the plan (the parts' addresses, the tokens), checked
here, because the kernel reads raw addresses and checks no bounds.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from ft import cpuinfo, settings
from ft.engine.cpu import layer_kernel as K
from ft.engine.cpu.compute import ExpertJob, check_parts
from ft.engine.cpu.phases import CallPhases
from ft.engine.cpu.sync import SHARED_SPIN_S, SHORT_SPIN_S, control_block, spin_cycles
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


def _refusal(status: int, layout: BankLayout) -> str:
    """What layer_kernel.start_routed refused, in words."""
    return {
        K.OUTSIDE_BANK: f"experts must lie in [0, {layout.experts})",
        K.REPEATED: "an expert is given twice",
        K.NOT_ROUTED: "no token is routed to the given experts",
    }[status]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of `dtype`: t itself where it is one (no torch op: a call's
    submit runs right after the last call streamed the caches, where each op costs ~10x)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


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


def int_dot_tokens(fmt: str, weight_dtype: torch.dtype) -> int:
    """The most tokens an expert of `fmt` may have in a call and still take the integer dot
    (0: never; the kernel's rule holds for every count up to it)."""
    n = 0
    while n < 64 and act_rounding(fmt, weight_dtype, n + 1) is q8_0:
        n += 1
    return n


class LayerHandle:
    """One submitted call; wait() returns [T, D] float32 (the sum over its experts)."""

    def __init__(self, calls: LayerCalls, gen: int, out: torch.Tensor, keep: tuple,
                 experts: int, stamps: np.ndarray | None = None,
                 published: int = 0) -> None:  # fmt: skip
        self._calls, self.gen, self._out = calls, gen, out
        self.experts = experts  # expert FFNs in the call
        self._keep = keep  # what the workers read by address: alive until the call is done
        self._finished = False
        self.ran_on: set[str] = set()
        # with stamping: the workers' stamps [workers, STAMP_COUNT], and the caller's time-stamp
        # counter as it published the call and as its wait saw it done
        self.stamps, self.published, self.returned = stamps, published, 0
        self.caller_units = 0  # units of the call its wait() computed (LayerCalls.wait)

    def done(self) -> bool:
        return self._finished or self._calls.finished(self.gen)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Blocks until the workers are done (the GIL released). `timeout` is the task path's
        argument and is not used here: the workers run compiled code that cannot raise (submit
        checked the plan), so every call ends once each worker has run its share."""
        if not self._finished:
            self.returned, self.caller_units = self._calls.wait(self.gen)
            self._finished, self._keep = True, ()
            self.ran_on = set(self._calls.names)
        return self._out

    def phases(self) -> CallPhases | None:
        """Where the call's time went, per worker (None: the call was not stamped). Waits for
        the call first."""
        self.wait()
        if self.stamps is None:
            return None
        return CallPhases.of(self.stamps, self.published, self.returned)


class LayerCalls:
    """The control block the workers wait on, and the plans sent through it."""

    def __init__(self, names: list[str], worker_cores: list[int]) -> None:
        """One worker per name, pinned to `worker_cores` (one core each, in order; empty where
        no worker is pinned). A thread with a core of its own spins FT_CPU_MOE_SPIN_US for the
        next call before it sleeps (sync says why others spin less)."""
        self.workers, self.names = len(names), names
        own_core = bool(set(cpuinfo.allowed_cores()) - set(worker_cores))  # no worker pinned there
        cores_each = len(set(worker_cores)) == len(worker_cores)  # no two workers on one core
        spin_s = settings.cpu_moe_spin_us() * 1e-6
        worker_s = spin_s if own_core else min(spin_s, SHORT_SPIN_S)
        self.worker_spin = spin_cycles(worker_s if cores_each else min(spin_s, SHARED_SPIN_S))
        self.caller_spin = spin_cycles(spin_s if own_core else min(spin_s, SHARED_SPIN_S))
        # The caller computes in wait() what no worker has claimed yet, on its own core only
        # (beside a worker it would take that worker's time); one waiter at a time, its buffers
        self.caller_helps = own_core
        self._pinned = frozenset(worker_cores)  # where the caller does not help
        self._worker_cores = np.zeros(max(worker_cores, default=-1) + 1, np.uint8)
        self._worker_cores[list(self._pinned)] = 1  # the same, as the kernel reads it
        self._help = threading.Lock()
        self._scratch = np.empty(0, np.uint8)
        K.compile_all()
        self.ctrl = control_block(K.control_words(self.workers))
        self._gen = 0
        self._last: LayerHandle | None = None
        self._lock = threading.Lock()  # submits from two threads publish one after the other
        self._layouts: dict[tuple, tuple] = {}  # bank_layout's and the parts it checked
        # each call's workers stamp the time-stamp counter at each point of their share
        # (`ft bench cpu-moe --phases`); off, the kernel only tests a plan word
        self.stamping = False

    def serve(self, worker: int) -> None:
        """The worker thread's whole life (returns on stop)."""
        K.serve(self.ctrl, worker, self.worker_spin)

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

    def wait(self, gen: int) -> tuple[int, int]:
        """Blocks until call `gen` is done, helping with it where the caller has a core of its
        own and runs there, on no worker's core (help_and_wait); -> (the time-stamp counter as
        the wait saw it done, the units this thread ran)."""
        if self.caller_helps and self._help.acquire(blocking=False):
            try:
                returned, ran, self._scratch = K.help_and_wait(
                    self.ctrl, gen, self.workers, self._scratch, self.caller_spin,
                    self._worker_cores,
                )  # fmt: skip
                if ran < 0:  # it only waited, on a worker's core
                    self._step_off_the_workers()
                return returned, max(ran, 0)
            finally:
                self._help.release()
        returned = K.wait_done(self.ctrl, gen, self.workers, self.caller_spin)
        if self.caller_helps:  # another thread helps: done once it has left its last unit
            with self._help:
                pass
        return returned, 0

    def _step_off_the_workers(self) -> None:
        """Move this thread to a core no worker is pinned to, then give it back the affinity it
        had: the scheduler left the caller beside a worker for whole runs of calls (Zen 2, the
        first cell after a store was filled: 25-30 calls of 30), and a moved thread stays where
        it was put until the scheduler moves it again. A thread pinned to workers' cores alone
        stays there."""
        me = threading.get_native_id()
        allowed = os.sched_getaffinity(me)
        free = allowed - self._pinned
        if free:
            os.sched_setaffinity(me, free)
            os.sched_setaffinity(me, allowed)

    def submit(self, x: torch.Tensor, jobs: list[ExpertJob]) -> LayerHandle:
        """Publish the jobs (all of one format, weights on the host) as one call."""
        return self._publish(*build_plan(x, jobs, self.workers))

    def submit_routed(
        self, x: torch.Tensor, bank: dict[str, torch.Tensor], fmt: str,
        topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: list[int],
    ) -> LayerHandle:  # fmt: skip
        """As submit(x, expert_jobs(bank, topk_ids, topk_weights, experts, fmt)): of `experts`,
        those the routing sends a token to, each with its tokens in order; the call built and
        published by one compiled pass (layer_kernel.start_routed) from the bank's addresses, no
        Python per expert. ValueError for an expert outside the bank or given twice, routing
        that does not match x, or experts no token reaches. The tensors must be on the CPU."""
        layout = self._layout(bank, fmt, x.shape[1])
        ids, weights = _as(topk_ids, torch.int64), _as(topk_weights, torch.float32)
        x_bf16 = x.dtype == torch.bfloat16
        x = (x if x.is_contiguous() else x.contiguous()) if x_bf16 else _as(x, torch.float32)
        tokens = x.shape[0]
        if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != tokens:
            raise ValueError(f"routing {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)} "
                             f"does not match x {tuple(x.shape)}")  # fmt: skip
        out = torch.empty(tokens, layout.hidden, dtype=torch.float32)  # 64-byte aligned: OUT_LINE
        stamps = np.zeros((self.workers, K.STAMP_COUNT), np.int64) if self.stamping else None
        with self._lock:
            if self._last is not None:
                self._last.wait()
            gen = self._gen + 1
            status, call, published = K.start_routed(
                self.ctrl, gen, 0 if stamps is None else stamps.ctypes.data, layout.words,
                ids.data_ptr(), weights.data_ptr(), tokens, ids.shape[1],
                np.asarray(experts, np.int64), self.workers, x.data_ptr(), x_bf16, out.data_ptr(),
            )  # fmt: skip
            if status < 0:
                raise ValueError(_refusal(status, layout))
            self._gen = gen
            # the bank read by address, kept alive with the call's words
            self._last = LayerHandle(self, gen, out, (call, bank), status, stamps, published)
        return self._last

    def _layout(self, bank: dict[str, torch.Tensor], fmt: str, hidden: int) -> BankLayout:
        """The bank's layout, checked once per bank (bank_layout): found again by the dict's
        identity, then each part it checked compared by identity and address (a submit's every
        line is slow right after a call has streamed the caches); checked again otherwise."""
        key = (id(bank), fmt, hidden)
        found = self._layouts.get(key)
        if found is not None:
            layout, checked = found
            for name, ref, at in checked:
                t = bank.get(name)
                if t is not ref() or t.data_ptr() != at:
                    break
            else:
                return layout
        if len(self._layouts) > 1024:  # banks come and go (tests, benchmarks): keep it small
            self._layouts.clear()
        layout = bank_layout(bank, fmt, hidden)  # every part present: checked
        names = kernel_format(fmt, bank["w13"].dtype)[1]
        self._layouts[key] = (layout, [(n, weakref.ref(bank[n]), bank[n].data_ptr())
                                       for n in names])  # fmt: skip
        return layout

    def _publish(self, plan: np.ndarray, keep: tuple, out: torch.Tensor) -> LayerHandle:
        """Start `plan` (its first words; the rest what it points at) once the last call is
        done: the workers share one control block."""
        stamps = None
        if self.stamping:
            stamps = np.zeros((self.workers, K.STAMP_COUNT), np.int64)
            plan[K.STAMPS] = stamps.ctypes.data
        with self._lock:
            if self._last is not None:
                self._last.wait()
            self._gen += 1
            handle = LayerHandle(self, self._gen, out, (plan, *keep), int(plan[K.EXPERTS]),
                                 stamps)  # fmt: skip
            handle.published = K.start_call(self.ctrl, plan.ctypes.data, self._gen)
            self._last = handle
        return handle


@dataclass(frozen=True)
class BankLayout:
    """Where a layer's host bank (part -> [E, ...], each expert's part contiguous) keeps each
    expert's parts: the plan's part words of expert e are base + e * stride (0 for parts the
    format lacks)."""

    code: int  # the kernel's format
    experts: int  # E
    hidden: int  # D
    inter: int  # I
    base: np.ndarray  # [PARTS] int64: expert 0's part addresses
    stride: np.ndarray  # [PARTS] int64: bytes from one expert's part to the next's

    @cached_property
    def words(self) -> np.ndarray:
        """All of it as layer_kernel.start_routed reads it (BANK_WORDS int64)."""
        words = np.zeros(K.BANK_WORDS, np.int64)
        words[: K.BANK_BASE] = self.code, self.experts, self.hidden, self.inter
        words[K.BANK_BASE : K.BANK_STRIDE], words[K.BANK_STRIDE :] = self.base, self.stride
        return words


def bank_layout(bank: dict[str, torch.Tensor], fmt: str, hidden: int) -> BankLayout:
    """The bank's layout; ValueError for what the kernel cannot read safely (a part missing, of
    the wrong shape or dtype for (D, I), not contiguous, not on the CPU)."""
    w13 = bank["w13"]
    code_parts = kernel_format(fmt, w13.dtype)
    if code_parts is None:
        raise ValueError(f"no layer kernel for {fmt} experts of {w13.dtype}")
    code, names = code_parts
    experts, inter = w13.shape[0], w13.shape[1] // 2
    base, stride = np.zeros(K.PARTS, np.int64), np.zeros(K.PARTS, np.int64)
    for p, name in enumerate(names):
        t = bank.get(name)
        if t is None:
            raise ValueError(f"{fmt} bank has no part {name}")
        if t.device.type != "cpu":
            raise ValueError(f"{fmt} bank part {name} is on {t.device}, needs the CPU")
        # the kernel walks an expert's rows by address; experts may sit apart (a store that
        # packs each expert's parts together)
        if t.dim() < 2 or t.shape[0] != experts or not t[0].is_contiguous():
            raise ValueError(f"{fmt} bank part {name}: want [{experts}, ...] of contiguous experts")
        base[p], stride[p] = t.data_ptr(), t.stride(0) * t.element_size()
    check_parts(get_format(fmt), {name: bank[name][0] for name in names}, hidden, inter)
    return BankLayout(code, experts, hidden, inter, base, stride)


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
    keep = [job.parts for job in jobs]
    return _finish_plan(plan, code, x, inter, starts, rows, weights, workers, keep)


def _finish_plan(plan, code, x, inter, starts, rows, weights, workers, keep):
    """The plan's header; -> (plan, arrays it points at, out [T, D])."""
    tokens, hidden = x.shape
    xs = x.to(torch.float32).contiguous()
    act = np.empty((max(int(starts[-1]), 1), inter), np.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    _header(plan, code, len(starts) - 1, xs, inter, workers, act, out, starts, rows, weights)
    return plan, (xs, act, starts, rows, weights, keep), out


def _header(plan, code, experts, xs, inter, workers, act, out, starts, rows, weights) -> None:
    """The plan's header words: xs [T, D] float32 and out contiguous tensors, the rest arrays."""
    tokens, hidden = xs.shape
    plan[: K.TOKEN_WEIGHT + 1] = (
        code, experts, tokens, hidden, inter, workers, xs.data_ptr(), act.ctypes.data,
        out.data_ptr(), starts.ctypes.data, rows.ctypes.data, weights.ctypes.data,
    )  # fmt: skip
