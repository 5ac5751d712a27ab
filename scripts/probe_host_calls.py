"""What the host pays per call for the CUDA work an offload stop issues (torch only, no model):
the median microseconds of each call, over --iters calls, on the GPU box.

    python scripts/probe_host_calls.py [--iters 2000]

Calls: an expert part's copy into a slot from pinned memory (the caching host allocator's, as
the store allocates it, and the same pages registered with cudaHostRegister), the stream context
the copies run in, an event's creation and record, its query, a stream's wait on it,
`current_stream`, a graph's replay (30 small kernels), and a [1, 24] id read-back (`tolist`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def per_call(fn, iters: int, setup=None) -> float:
    """Median host microseconds of fn() over iters calls (setup() before each, not timed)."""
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return round(statistics.median(times) / 1e3, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    dev, n = torch.device("cuda"), a.iters
    part = 4096  # bytes of a small part: the call's cost, not the copy's
    cached = torch.empty(64, part, dtype=torch.uint8, pin_memory=True)  # caching host allocator
    plain = torch.empty(64, part, dtype=torch.uint8)
    registered = torch.cuda.cudart().cudaHostRegister(plain.data_ptr(), plain.numel(), 0)
    slots = torch.empty(64, part, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    result: dict[str, float] = {}
    i = iter(range(1 << 30))

    def copy_from(host):
        j = next(i) % 64
        slots[j].copy_(host[j], non_blocking=True)

    with torch.cuda.stream(stream):
        result["copy_, caching-allocator pinned"] = per_call(lambda: copy_from(cached), n)
        if int(registered) == 0:
            result["copy_, cudaHostRegister'd"] = per_call(lambda: copy_from(plain), n)
    stream.synchronize()

    def enter_exit():
        with torch.cuda.stream(stream):
            pass

    result["with torch.cuda.stream(s): pass"] = per_call(enter_exit, n)
    result["torch.cuda.set_stream(s) twice"] = per_call(
        lambda: (torch.cuda.set_stream(stream), torch.cuda.set_stream(torch.cuda.default_stream())),
        n,
    )
    result["torch.cuda.Event()"] = per_call(torch.cuda.Event, n)
    event = torch.cuda.Event()
    result["event.record(stream)"] = per_call(lambda: event.record(stream), n)
    result["event.query() (done)"] = per_call(event.query, n)
    result["stream.wait_event(event)"] = per_call(lambda: stream.wait_event(event), n)
    result["current_stream(device)"] = per_call(lambda: torch.cuda.current_stream(dev), n)
    result["tensor index host[j] (a view)"] = per_call(lambda: cached[next(i) % 64], n)
    torch.cuda.synchronize()

    x = torch.zeros(1, 2048, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x
        for _ in range(30):
            y = y * 1.0001
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(30):
            y = y * 1.0001
    result["graph.replay() (30 kernels)"] = per_call(graph.replay, n, torch.cuda.synchronize)
    start = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    result["graph of 30 kernels, back to back on the GPU (us a replay)"] = round(
        (time.perf_counter() - start) / 200 * 1e6, 2
    )
    ids = torch.zeros(1, 24, dtype=torch.long, device=dev)
    result["ids.tolist() (idle GPU)"] = per_call(ids.tolist, n)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
