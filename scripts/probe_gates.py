"""Does a device gate (ft.engine.gates) open and close on this GPU? Each way, with a deadline,
one JSON line: a wait kernel queued on one stream must not pass before the host opens it (by a
store into pinned memory, or by a copy queued on another stream), and must pass after; a signal
kernel's rows must reach the host. Exits at the first way that hangs (os._exit: a kernel may
still spin).

    python scripts/probe_gates.py
"""

from __future__ import annotations

import json
import os
import time

import torch

from ft.engine.gates import StopGates


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def passes(event: torch.cuda.Event, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            return False
    return True


def main() -> None:
    table_host = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8).pin_memory()
    table_device = torch.full((2, 8), -1, dtype=torch.int32, device="cuda")
    gates = StopGates(2, max_batch=2, columns=3, table_host=table_host, table_device=table_device)
    gates.rehearsal().wait(0, 0)  # compile and load the kernels, as a capture's warm-up does
    gates.rehearsal().signal(torch.zeros(2, 3, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    compute, copies = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    for k, way in enumerate(("host store", "stream copy")):
        with torch.cuda.stream(compute):
            gates.wait(k, layer=k)
            done = torch.cuda.Event()
            done.record(compute)
        early = passes(done, 0.2)
        start = time.perf_counter()
        gates.open(k, None if way == "host store" else copies)
        ok = passes(done, 5.0)
        emit(way=way, passed_before_open=early, passed_after_open=ok,
             us_to_pass=round((time.perf_counter() - start) * 1e6, 1),
             row=table_device[k].tolist() if ok else None)  # fmt: skip
        if not ok:
            os._exit(1)
    stop = torch.arange(6, dtype=torch.long, device="cuda").reshape(2, 3)
    with torch.cuda.stream(compute):
        gates.signal(stop)
    start = time.perf_counter()
    rows = gates.rows_of(2, timeout=5.0)
    emit(way="signal", rows=rows, us=round((time.perf_counter() - start) * 1e6, 1))
    # a round trip as decode makes one: signal -> host poll -> open -> the gate passes
    trips = []
    for _ in range(200):
        with torch.cuda.stream(compute):
            gates.signal(stop)
            gates.wait(0, layer=0)
            done = torch.cuda.Event()
            done.record(compute)
        gates.rows_of(2)
        start = time.perf_counter()
        gates.open(0)
        passes(done, 5.0)
        trips.append((time.perf_counter() - start) * 1e6)
    trips.sort()
    emit(way="open -> pass", median_us=round(trips[100], 1), p90_us=round(trips[180], 1))


if __name__ == "__main__":
    main()
