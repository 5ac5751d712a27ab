"""Whether a host-to-device copy on a second stream waits for copies queued on another: the
question behind where a demand miss should be queued (round AN in docs/perf.md). Torch only, no
model; pinned source, one expert's size (qwen3-30b-a3b, bf16: 3 parts of 2048 x 768).

    python scripts/probe_copy_engines.py [--queued 6] [--repeats 20]

Prints one JSON line: the median device microseconds of one expert's copy alone; of a copy on
stream B issued right after `--queued` copies on stream A (B from the moment it was queued to
its end; B high priority, then normal); and of A's whole queue in each case. If B's figure is
near the lone copy's, copies on two streams run side by side (sharing PCIe or not); if it is
near the queue's, the copy engine serves them in order. Last, `--queued` copies split over two
streams, issued alternately: their span against one stream's queue tells whether two streams
add bandwidth. And how the copy's granularity costs: `--queued` experts queued on one stream as
the engine copies them (three parts, then a 4-byte ready mark), as three parts alone, and as one
contiguous block each (a host layout with an expert's parts side by side); and with the mark
written from the stream's queue (a driver stream memory operation, as the cache now does).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ft.engine.experts.stream_write import stream_writer

PART = (2048, 768)  # one of an expert's three matrices, bf16: 3.1 MB


def expert(pinned: bool, device=None) -> list[torch.Tensor]:
    if device is not None:
        return [torch.empty(PART, dtype=torch.bfloat16, device=device) for _ in range(3)]
    return [torch.randn(PART).to(torch.bfloat16).pin_memory() for _ in range(3)]


def copy(dst, src) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)


def timed(stream, fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    return start, end


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queued", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sources = [expert(True) for _ in range(args.queued + 1)]
    slots = [expert(False, dev) for _ in range(args.queued + 1)]
    a = torch.cuda.Stream()
    results: dict[str, list[float]] = {}

    def record(name, events):
        results.setdefault(name, []).append(events[0].elapsed_time(events[1]) * 1000)

    for priority in (-1, 0):
        b = torch.cuda.Stream(priority=priority)
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            alone = timed(b, lambda: copy(slots[-1], sources[-1]))
            torch.cuda.synchronize()
            record("alone_us", alone)

            def queue():
                for i in range(args.queued):
                    copy(slots[i], sources[i])

            queue_events = timed(a, queue)
            b_events = timed(b, lambda: copy(slots[-1], sources[-1]))
            torch.cuda.synchronize()
            record(f"queue_us_b_priority{priority}", queue_events)
            record(f"b_behind_queue_us_priority{priority}", b_events)
    # both streams with a queue: if the pair takes as long as one queue, the copies ran side by
    # side at full speed; twice as long, they shared the link
    b = torch.cuda.Stream()
    half = args.queued // 2
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a.wait_stream(torch.cuda.current_stream())
        b.wait_stream(torch.cuda.current_stream())
        for i in range(half):
            with torch.cuda.stream(a):
                copy(slots[i], sources[i])
            with torch.cuda.stream(b):
                copy(slots[half + i], sources[half + i])
        torch.cuda.current_stream().wait_stream(a)
        torch.cuda.current_stream().wait_stream(b)
        end.record()
        torch.cuda.synchronize()
        results.setdefault(f"two_streams_{2 * half}_copies_us", []).append(
            start.elapsed_time(end) * 1000
        )
    # granularity: the same bytes per expert, in 3 parts + a mark, 3 parts, or one block
    blocks_src = [torch.cat([p.flatten() for p in src]).pin_memory() for src in sources]
    blocks_dst = [torch.empty_like(b, device=dev) for b in blocks_src]
    mark = torch.zeros(1, dtype=torch.int32).pin_memory()
    ready = torch.zeros(1, dtype=torch.int32, device=dev)

    def parts_and_mark():
        for i in range(args.queued):
            copy(slots[i], sources[i])
            ready.copy_(mark, non_blocking=True)

    def parts():
        for i in range(args.queued):
            copy(slots[i], sources[i])

    def one_block():
        for i in range(args.queued):
            blocks_dst[i].copy_(blocks_src[i], non_blocking=True)

    write = stream_writer(0)

    def parts_and_written_mark():  # the mark from the stream's queue: no turn of the copy engine
        for i in range(args.queued):
            copy(slots[i], sources[i])
            write(torch.cuda.current_stream().cuda_stream, ready.data_ptr(), i)

    variants = [("parts_mark", parts_and_mark), ("parts", parts), ("block", one_block)]
    if write is not None:
        variants.append(("parts_written_mark", parts_and_written_mark))
    for name, fn in variants:
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            events = timed(a, fn)
            torch.cuda.synchronize()
            record(f"queue_{name}_us", events)
    out = {k: round(statistics.median(v), 1) for k, v in results.items()}
    out["queued"] = args.queued
    out["expert_mb"] = round(3 * PART[0] * PART[1] * 2 / 1e6, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
