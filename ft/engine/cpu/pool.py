"""The CPU MoE executor: a pinned pool of worker threads computing expert FFNs from host weights.

Each worker is a Python thread named `ft-cpu-moe-K` (the OS name too, so probes can find it in
/proc), pinned to one core, with torch intra-op threads = 1. How the workers compute depends on
the compute mode (docs/cpu-pool.md):
- auto / compiled: each worker enters the layer kernel once (ft.engine.cpu.layer) and stays in
  compiled code, GIL released, until close(); a submit is one call for all of a layer's CPU
  experts, split so that every worker streams its own rows. No Python per expert or row block.
- float32 / native: the row-block task queue, kept for comparison (`ft bench bw`'s isa_sweep).
  Work is handed out as blocks of the intermediate dimension I: a task computes gate/up for its
  block, the activation, and multiplies by the matching columns of w2; each worker adds its
  partials into its own [T, D] buffer, and the waiter sums the buffers.
Work that does not reach the workers (forced inline, a closed pool, weights the layer kernel
does not read) runs on the caller, counted in experts_inline and warned once.
Shape legend: T = tokens, D = hidden, I = expert intermediate, n = tokens routed to one expert,
s = rows of I in one task.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft import cpuinfo, settings
from ft.engine.cpu.compute import (
    COMPUTE_MODES,
    ExpertJob,
    Slice,
    expert_jobs,
    make_slices,
    run_slice,
)
from ft.engine.cpu.threads import (  # noqa: F401  (log helpers: for the engine)
    format_cores,
    lower_torch_threads,
    name_os_thread,
    pick_cores,
    pin_to_core,
)
from ft.engine.formats import get_format
from ft.errors import FtError
from ft.log import get_logger

if TYPE_CHECKING:
    from ft.engine.cpu.layer import LayerHandle

log = get_logger("ft.engine.cpu.pool")

THREAD_PREFIX = "ft-cpu-moe-"
LAYER_MODES = ("auto", "compiled")  # compute modes whose workers run the layer kernel


@dataclass(frozen=True)
class CpuMoeStats:
    experts_in_pool: int  # expert FFNs computed by the pool's workers
    experts_inline: int  # computed anywhere else (the calling thread): must be visible


class CpuMoeHandle:
    """The result of one submit(); wait() blocks (no spinning) until every task is done."""

    def __init__(self, x: torch.Tensor, tasks: int, workers: int) -> None:
        self._shape = (x.shape[0], x.shape[1])
        self._partials: list[torch.Tensor | None] = [None] * max(workers, 1)  # one per worker
        self._remaining = tasks
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: torch.Tensor | None = None
        self.ran_on: set[str] = set()  # names of the threads that computed this handle's tasks
        if tasks == 0:
            self._done.set()

    def partial(self, worker: int) -> torch.Tensor:
        buf = self._partials[worker]
        if buf is None:  # lazily: at decode most workers touch few handles' rows
            buf = self._partials[worker] = torch.zeros(self._shape, dtype=torch.float32)
        return buf

    def task_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """[T, D] float32: the sum over jobs of weights * FFN(x[rows]), scattered to rows."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"CPU MoE tasks not done after {timeout} s")
        if self._error is not None:
            raise RuntimeError("a CPU MoE worker failed") from self._error
        if self._result is None:  # sum once: wait() may be called again
            parts = [p for p in self._partials if p is not None]
            out = parts[0] if parts else torch.zeros(self._shape, dtype=torch.float32)
            for p in parts[1:]:
                out += p
            self._result, self._partials = out, []
        return self._result


class CpuMoeExecutor:
    """A pool of pinned worker threads; submit(x, jobs) returns a handle at once."""

    def __init__(
        self,
        threads: int | None = None,
        cores: list[int] | None = None,
        *,
        compute: str = "auto",  # "auto" | "float32" | "native" | "compiled" (module note)
        min_slice: int = 64,  # fewest rows of I in one task: below it, per-op cost dominates
        tasks_per_thread: int = 1,  # tasks per worker per submit: more balance, more overhead
        force_inline: bool | None = None,  # fault injection: compute on the caller, not the pool
    ) -> None:
        if compute not in COMPUTE_MODES:
            raise FtError(
                f"CPU MoE compute must be one of {', '.join(COMPUTE_MODES)}, got {compute!r}"
            )
        self.cores = pick_cores(threads, cores)
        self.threads = len(self.cores)
        self.compute = compute
        self.min_slice = max(1, min_slice)
        self.tasks_per_thread = max(1, tasks_per_thread)
        self.force_inline = (
            settings.cpu_moe_force_inline() if force_inline is None else force_inline
        )
        self.native_ids: list[int] = [0] * self.threads
        self._layer = self._layer_calls() if compute in LAYER_MODES else None
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()  # blocking get: no busy-waiting
        self._in_pool = [0] * self.threads  # one writer each: no lock needed
        self._inline = 0
        self._warned_inline = False
        self._closed = False
        self.worker_torch_threads: list[int] = [0] * self.threads  # each worker's, after setup
        self._started = threading.Barrier(self.threads + 1)  # returns once all are pinned
        caller_threads = torch.get_num_threads()
        self._workers = [self._start_worker(k) for k in range(self.threads)]
        self._started.wait()
        # The workers' set_num_threads(1) also wrote torch's process-wide default, which every
        # thread started later would inherit (the engine's own thread among them): put it back.
        torch.set_num_threads(caller_threads)

    # -- lifecycle ------------------------------------------------------------------------------

    def _layer_calls(self):
        """auto / compiled: the workers wait in the layer kernel, one call per submit
        (ft.engine.cpu.layer); float32 / native: they take row-block tasks from a queue."""
        from ft.engine.cpu.layer import LayerCalls  # numba: imported where it is used

        return LayerCalls([f"{THREAD_PREFIX}{k}" for k in range(self.threads)], self.cores)

    def _start_worker(self, k: int) -> threading.Thread:
        t = threading.Thread(
            target=self._worker, args=(k,), name=f"{THREAD_PREFIX}{k}", daemon=True
        )
        t.start()
        return t

    def close(self) -> None:
        """Stop and join the workers; later submits run inline (counted and warned)."""
        if self._closed:
            return
        self._closed = True
        if self._layer is not None:
            self._layer.stop()
        for _ in self._workers:
            self._tasks.put(None)
        for t in self._workers:
            t.join()

    def __enter__(self) -> CpuMoeExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def computing_threads(self) -> int:
        """Threads that compute a layer call: the workers, and its caller where it has a core
        of its own (it takes what the workers have not started when it waits)."""
        return self.threads + bool(self._layer is not None and self._layer.caller_helps)

    @property
    def alive(self) -> bool:
        return not self._closed and all(t.is_alive() for t in self._workers)

    @property
    def stats(self) -> CpuMoeStats:
        return CpuMoeStats(experts_in_pool=sum(self._in_pool), experts_inline=self._inline)

    def stamp_phases(self, on: bool = True) -> bool:
        """Whether each layer call's workers stamp the phases of their share (a call's handle
        then gives them: LayerHandle.phases; `ft bench cpu-moe --phases`); -> whether this pool
        can: only the layer kernel stamps."""
        if self._layer is None:
            return False
        self._layer.stamping = on
        return True

    def act_rounding(self, fmt: str, weight_dtype: torch.dtype, tokens: int):
        """How this pool rounds the activations of an expert of `fmt` with `tokens` tokens in
        a submit (a function on float32 tensors, for a reference to model it), or None: float32
        throughout."""
        if self._layer is None:
            return None  # the row-block tasks compute in float32
        from ft.engine.cpu.layer import act_rounding

        return act_rounding(fmt, weight_dtype, tokens)

    # -- work -----------------------------------------------------------------------------------

    def submit(self, x: torch.Tensor, jobs: list[ExpertJob]) -> CpuMoeHandle | LayerHandle:
        """Start the jobs on the workers and return at once; x is [T, D] on the CPU."""
        _check_on_cpu(("x", x), *((f"jobs[{i}].{n}", t) for i, j in enumerate(jobs)
                                  for n, t in (*j.parts.items(), ("rows", j.rows),
                                               ("weights", j.weights))))  # fmt: skip
        jobs = [j for j in jobs if j.rows.numel() > 0]
        if self.force_inline or not self.alive:
            return self._run_inline(x, jobs)
        if self._layer is not None and jobs:
            dtype = jobs[0].parts["w13"].dtype
            if not self._layer.reads(jobs[0].fmt, dtype):
                reason = f"the layer kernel has no {str(dtype).removeprefix('torch.')} weights"
                return self._run_inline(x, jobs, reason)
            handle = self._layer.submit(x, jobs)
            self._in_pool[0] += len(jobs)  # counted at submit: no worker runs Python to count
            return handle
        slices = self._plan(x, jobs)
        handle = CpuMoeHandle(x, len(slices), self.threads)
        for sl in slices:
            self._tasks.put((handle, sl))
        return handle

    def submit_routed(
        self, x: torch.Tensor, bank: dict[str, torch.Tensor], fmt: str,
        topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: list[int],
    ) -> CpuMoeHandle | LayerHandle:  # fmt: skip
        """A layer's CPU share from its routing: submit(x, expert_jobs(bank, topk_ids,
        topk_weights, experts, fmt)), where the layer kernel reads the bank without a job per
        expert (the plan from the bank's addresses). x [T, D], topk_ids / topk_weights [T, K] and
        the bank (part -> [E, ...], format `fmt`) on the CPU."""
        # Each line here runs on the engine's thread right after a call has streamed the caches,
        # at ~1-5 us a line: the layer kernel's workers leave it only at close() (no thread to
        # check per call: 15 is_alive() cost ~47 us), and the tensors' devices are read as flags
        layer = self._layer
        reads = layer is not None and layer.reads(fmt, bank["w13"].dtype)
        if self.force_inline or self._closed or not reads:
            return self.submit(x, expert_jobs(bank, topk_ids, topk_weights, experts, fmt))
        if not (x.is_cpu and topk_ids.is_cpu and topk_weights.is_cpu):
            _check_on_cpu(("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
        handle = layer.submit_routed(x, bank, fmt, topk_ids, topk_weights, experts)
        self._in_pool[0] += handle.experts  # counted at submit: no worker runs Python to count
        return handle

    def _plan(self, x: torch.Tensor, jobs: list[ExpertJob]) -> list[Slice]:
        """Cut each expert's I into blocks so that the pool has ~tasks_per_thread each."""
        want = math.ceil(self.threads * self.tasks_per_thread / max(len(jobs), 1))
        slices = []
        for job in jobs:
            align = get_format(job.fmt).align
            blocks = split_range(job.inter, want, self.min_slice, align)
            slices += make_slices(job, x, self.compute, blocks)
        return slices

    def _run_inline(
        self, x: torch.Tensor, jobs: list[ExpertJob], reason: str | None = None
    ) -> CpuMoeHandle:
        handle = CpuMoeHandle(x, 0, 1)
        forced = "forced (--cpu-moe-inline / FT_CPU_MOE_INLINE)"
        reason = reason or (forced if self.force_inline else "the pool is closed")
        for job in jobs:
            (whole,) = make_slices(job, x, self.compute, [(0, job.inter)])
            run_slice(whole, handle.partial(0), scratch={})
        handle.ran_on.add(threading.current_thread().name)
        self._inline += len(jobs)
        if jobs and not self._warned_inline:
            self._warned_inline = True
            log.warning(
                "CPU MoE: %d expert(s) computed outside the pool, on thread %r: %s; "
                "counted in experts_cpu_inline",
                len(jobs),
                threading.current_thread().name,
                reason,
            )
        return handle

    def _worker(self, k: int) -> None:
        self.native_ids[k] = threading.get_native_id()
        name_os_thread(f"{THREAD_PREFIX}{k}")
        pin_to_core(self.cores[k])
        # One intra-op thread: the worker is pinned to one core, so an inner OpenMP/MKL team
        # would only fight its neighbours. get_ first: torch sets a thread's count up lazily on
        # its first use, from the process default, which would undo the set_ below.
        torch.get_num_threads()
        torch.set_num_threads(1)
        self.worker_torch_threads[k] = torch.get_num_threads()
        self._started.wait()
        if self._layer is not None:
            self._layer.serve(k)  # compiled code until close(): no Python per call
            return
        scratch: dict = {}
        name = threading.current_thread().name
        while (item := self._tasks.get()) is not None:
            handle, sl = item
            try:
                run_slice(sl, handle.partial(k), scratch)
                handle.ran_on.add(name)
                if sl.first:
                    self._in_pool[k] += 1
                handle.task_done()
            except BaseException as exc:  # hand it to wait(); never kill the worker
                handle.task_done(exc)


def _check_on_cpu(*tensors: tuple[str, torch.Tensor]) -> None:
    """Fail in the caller, not later in a worker: everything the pool reads is host memory."""
    for name, t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"CpuMoeExecutor.submit: {name} is on {t.device}, needs the CPU")


def split_range(n: int, parts: int, min_size: int, align: int = 1) -> list[tuple[int, int]]:
    """[0, n) cut into at most `parts` near-equal blocks of at least min_size (one if n small),
    every bound a multiple of `align` (n itself is one)."""
    units = n // align  # cut in whole units of `align`
    parts = max(1, min(parts, n // max(min_size, 1), max(units, 1)))
    bounds = [round(i * units / parts) * align for i in range(parts)] + [n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def ready_line(
    pool: CpuMoeExecutor,
    *,
    fmt: str,
    hidden: int,
    intermediate: int,
    experts: int,
    layers: int,
    top_k: int,
) -> str:
    """The startup line probes parse (docs/engine.md); the engine supplies the shape."""
    cores = format_cores(pool.cores)
    return (
        f"CPU MoE executor ready: threads={pool.threads} (pinned to cores {cores})"
        f" isa={cpuinfo.best_isa()} fmt={fmt} H={hidden} I={intermediate} experts={experts}"
        f" layers={layers} top_k={top_k}"
    )


def log_ready(pool: CpuMoeExecutor, **shape: int | str) -> None:
    """Log ready_line(pool, **shape): fmt, hidden, intermediate, experts, layers, top_k."""
    log.info("%s", ready_line(pool, **shape))
