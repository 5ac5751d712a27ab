"""Can the GPU fetch experts from host memory by itself? A feasibility probe for offload without
host stops (a decode step as one CUDA graph: a kernel copies each missed expert from pinned host
memory, mapped into the device's address space, into its cache slot; no cudaMemcpy, whose
addresses would have to be known when the graph is captured).

For one qwen3-30b-a3b expert (9.44 MB, bf16), prints one JSON line per way of moving it:
  - "copy_engine": slot.copy_(pinned, non_blocking=True): what offload does today (DMA);
  - "sm_read/P": a Triton kernel of P programs reading the pinned pages through a device view
    of them (UVA) and writing the slot, for P from 8 to 132 (the H200's SMs);
  - "sm_read/P+busy": the same while another stream runs an HBM-bound kernel: how much the
    copy slows the compute, and the compute the copy, when they share the SMs.
Each line: GB/s over the expert's bytes, median of --iters, CUDA events; "ok" whether the slot
equals the source afterwards. Exits 0 with an "error" line where a way is not possible here.

    python scripts/bench_zero_copy.py [--iters 50] [--experts 4]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

EXPERT_BYTES = 3 * 2048 * 768 * 2  # gate, up, down of qwen3-30b-a3b in bf16


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (int32 words), each program striding over the whole range."""
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for base in range(start, n, step):
        offs = base + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def _busy_kernel(a, n, BLOCK: tl.constexpr):
    """Reads and rewrites a large HBM buffer: the stand-in for decode's compute."""
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for base in range(start, n, step):
        offs = base + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(a + offs, tl.load(a + offs, mask=ok) + 1, mask=ok)


class _DeviceView:
    """A CUDA-array-interface view of pinned host memory: with unified addressing, the pinned
    pages' host address is also their device address."""

    def __init__(self, host: torch.Tensor):
        assert host.is_pinned() and host.dtype == torch.int32
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": "<i4", "data": (host.data_ptr(), False),
            "version": 3, "strides": None,
        }  # fmt: skip


def device_view(host: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(_DeviceView(host), device="cuda")


def timed(fn, iters: int) -> float:
    """Median seconds of fn() over iters, each between two CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--experts", type=int, default=4, help="experts per timed copy")
    args = parser.parse_args()
    words = args.experts * EXPERT_BYTES // 4
    host = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32).pin_memory()
    slot = torch.empty(words, dtype=torch.int32, device="cuda")
    gbs = lambda s: round(args.experts * EXPERT_BYTES / s / 1e9, 2)  # noqa: E731
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         bytes=args.experts * EXPERT_BYTES)  # fmt: skip

    seconds = timed(lambda: slot.copy_(host, non_blocking=True), args.iters)
    emit(way="copy_engine", gbs=gbs(seconds), ok=bool(torch.equal(slot.cpu(), host)))

    try:
        view = device_view(host)
    except Exception as exc:  # noqa: BLE001 - a probe: report and stop
        emit(way="sm_read", error=f"no device view of pinned memory: {exc!r}"[:300])
        return
    busy = torch.zeros(1 << 28, dtype=torch.int32, device="cuda")  # 1 GiB: HBM-bound
    side = torch.cuda.Stream()
    for programs in (8, 16, 33, 66, 132):
        slot.zero_()

        def copy(p=programs):
            _copy_kernel[(p,)](view, slot, words, BLOCK=4096)

        try:
            seconds = timed(copy, args.iters)
        except Exception as exc:  # noqa: BLE001
            emit(way=f"sm_read/{programs}", error=repr(exc)[:300])
            return
        emit(way=f"sm_read/{programs}", gbs=gbs(seconds), ok=bool(torch.equal(slot.cpu(), host)))

        def overlapped(p=programs):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _busy_kernel[(132,)](busy, busy.numel(), BLOCK=4096)
            _copy_kernel[(p,)](view, slot, words, BLOCK=4096)
            torch.cuda.current_stream().wait_stream(side)

        alone = timed(lambda: _busy_kernel[(132,)](busy, busy.numel(), BLOCK=4096), args.iters)
        both = timed(overlapped, args.iters)
        emit(way=f"sm_read/{programs}+busy", busy_alone_ms=round(alone * 1e3, 3),
             both_ms=round(both * 1e3, 3), copy_alone_ms=round(seconds * 1e3, 3))  # fmt: skip


if __name__ == "__main__":
    main()
