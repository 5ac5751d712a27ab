"""How long the host takes to learn a stretch's routed ids once the GPU has them, three ways, with
the copy engine idle and busy (docs/perf.md, round AA: ~70 us of a b1 layer fall between a
stretch's end and the host holding its ids). Needs CUDA; torch only, no model.

Each iteration plays one MoE layer's stop: a kernel of ~100 us (the stretch), a tiny kernel that
writes the ids [1, 24] int32, then the host reads them:
  tolist   ids.tolist(), the engine's way today (a pageable device-to-host copy and its sync)
  pinned   ids copied into pinned host memory on the stream, then the copy's event waited on
  mapped   a kernel writes the ids straight into pinned host memory through its device address
           (no copy engine), and the host polls that memory for the new value
"busy": before each stretch, 9.4 MB expert copies from pinned memory are queued on a side stream
whenever fewer than 2 are in flight (as offload's prefetch window does).
Per way: the median and p90 of the iteration's host time, and that minus the stretch's own GPU
time (CUDA events): the read-back's cost.

    python scripts/probe_readback.py [--iters 300] [--stretch-us 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

EXPERT_BYTES = 9_437_184  # one qwen3-30b-a3b bf16 expert


class _Pinned:
    def __init__(self, host: torch.Tensor):
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": "<i4", "data": (host.data_ptr(), False),
            "version": 3, "strides": None,
        }  # fmt: skip


def stretch_cycles(us: float) -> int:
    """torch.cuda._sleep cycles that take `us` microseconds on this GPU, from a long sleep's rate
    (round AB scaled from short ones and got 17.6 us for 100: their fixed cost dominates)."""
    long = 2_000_000
    return int(us * long / min(gpu_us(long) for _ in range(3)))


def gpu_us(cycles: int) -> float:
    """The median GPU time of one torch.cuda._sleep(cycles), in us."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


class Copies:
    """Expert-sized copies from pinned memory on a side stream, at most `window` in flight."""

    def __init__(self, window: int = 2):
        self.src = torch.empty(EXPERT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.dst = [torch.empty(EXPERT_BYTES, dtype=torch.uint8, device="cuda") for _ in range(4)]
        self.stream = torch.cuda.Stream()
        self.window, self.events, self.count = window, [], 0

    def feed(self) -> None:
        self.events = [e for e in self.events if not e.query()]
        while len(self.events) < self.window:
            with torch.cuda.stream(self.stream):
                self.dst[self.count % 4].copy_(self.src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events.append(event)
            self.count += 1


def run(way: str, cycles: int, iters: int, copies: Copies | None) -> list[float]:
    ids = torch.zeros(1, 24, dtype=torch.int32, device="cuda")
    pinned = torch.zeros(1, 24, dtype=torch.int32, pin_memory=True)
    mapped = torch.as_tensor(_Pinned(pinned), device="cuda")
    seen = pinned.numpy()
    times = []
    for i in range(iters):
        if copies:
            copies.feed()
        start = time.perf_counter()
        torch.cuda._sleep(cycles)
        ids.fill_(i + 1)
        if way == "tolist":
            rows = ids.tolist()
        elif way == "pinned":
            pinned.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            rows = seen.tolist()
        else:
            torch.add(ids, 0, out=mapped)  # an elementwise kernel: SMs store to host memory
            deadline = start + 1.0
            while seen[0, 23] != i + 1:
                if time.perf_counter() > deadline:
                    raise RuntimeError("mapped write never arrived")
            rows = seen.tolist()
        times.append((time.perf_counter() - start) * 1e6)
        assert rows[0][0] == i + 1, (way, rows[0][0], i + 1)
    torch.cuda.synchronize()
    return times[10:]  # warm-up dropped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--stretch-us", type=float, default=100.0)
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    cycles = stretch_cycles(args.stretch_us)
    stretch = gpu_us(cycles)
    copies = Copies()
    results = {"gpu": torch.cuda.get_device_name(), "stretch_gpu_us": round(stretch, 1)}
    for load in ("idle", "busy"):
        for way in ("tolist", "pinned", "mapped"):
            try:
                times = run(way, cycles, args.iters, copies if load == "busy" else None)
            except Exception as exc:  # one way failing leaves the others measured
                results[f"{way}-{load}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            median = statistics.median(times)
            p90 = sorted(times)[int(len(times) * 0.9)]
            results[f"{way}-{load}"] = {
                "iter_us_median": round(median, 1), "iter_us_p90": round(p90, 1),
                "readback_us_median": round(median - stretch, 1),
            }  # fmt: skip
            print(json.dumps({way + "-" + load: results[f"{way}-{load}"]}), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
