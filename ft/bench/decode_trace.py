"""`ft bench decode --trace DIR`: where a decode step's time goes. After a (strategy, batch) is
timed, a few more decode steps run under torch.profiler (so the timed figures carry no profiler
overhead); DIR gets a Chrome trace (chrome://tracing, Perfetto) and a table of ops by self
time, host and device, plus the launches per step. On CUDA, the trace's device activity is also
summed per step (`timeline`): how long the GPU computed, how long it sat idle waiting for an
expert copy or for the host, and how long PCIe carried host-to-device copies."""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

TRACE_STEPS = 4
STEP_MARK = "ft.decode_step"  # a record_function range around each traced engine step
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
# a compute gap that ends within this many us of a copy's end waited for that copy: the
# stream's wait on the copy's event releases the next kernel a few us after the copy lands
COPY_RELEASE_US = 8.0


def trace_decode(engine, prompts: list[list[int]], out_dir: Path, name: str) -> dict:
    """Prefill `prompts`, then profile TRACE_STEPS decode steps; -> file paths and counts, and
    on CUDA the device `timeline` (us per step)."""
    from ft.engine.model.sampling import SamplingParams

    out_dir.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=TRACE_STEPS + 2, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # prefill, not traced
    engine.step()  # one decode step to settle caches
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(TRACE_STEPS):
            with record_function(STEP_MARK):
                engine.step()
    while engine.has_unfinished():
        engine.step()
    trace, table = out_dir / f"{name}.trace.json", out_dir / f"{name}.ops.txt"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table.write_text(averages.table(sort_by=sort, row_limit=40))
    launches = sum(e.count for e in averages if e.key in LAUNCHES) if cuda else None
    timeline = device_timeline(json.loads(trace.read_text())["traceEvents"]) if cuda else None
    return {"trace": str(trace), "ops": str(table), "steps": TRACE_STEPS,
            "launches_per_step": None if launches is None else launches / TRACE_STEPS,
            "timeline": timeline}  # fmt: skip


def device_timeline(events: list[dict]) -> dict | None:
    """Chrome-trace events of traced steps -> us per step (means over the STEP_MARK ranges):
    `step`; `compute`, the GPU running kernels; its idle time split into `wait_host` (nothing
    queued: up to the host's last launch before the gap ended) and `wait_copy` (the rest of a
    gap that ends as a host-to-device copy lands: queued work held by a copy's event); `pcie`,
    host-to-device copies in flight (either copy stream); `pcie_idle`. None without steps or
    device activity."""
    events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = lambda pick: [(e["ts"], e["ts"] + e["dur"]) for e in events if pick(e)]  # noqa: E731
    steps = spans(lambda e: e.get("name") == STEP_MARK and e.get("cat") != "gpu_user_annotation")
    h2d = spans(lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""))
    kernels = _union(spans(lambda e: e.get("cat") in ("kernel", "gpu_memset")))
    copies, copy_ends = _union(h2d), sorted(end for _, end in h2d)
    launches = sorted(a for a, _ in spans(lambda e: e.get("name") in LAUNCHES + GRAPH_LAUNCHES))
    if not steps or not kernels:
        return None
    total = dict.fromkeys(("step", "compute", "wait_copy", "wait_host", "pcie"), 0.0)
    for start, end in steps:
        total["step"] += end - start
        busy = _clip(kernels, start, end)
        total["compute"] += sum(b - a for a, b in busy)
        total["pcie"] += sum(b - a for a, b in _clip(copies, start, end))
        for gap_start, gap_end in _gaps(busy, start, end):
            held = gap_end < end and _ends_between(copy_ends, gap_end - COPY_RELEASE_US, gap_end)
            queued = _last_before(launches, gap_end) if held else gap_end
            host = min(max(queued, gap_start), gap_end) - gap_start
            total["wait_host"] += host
            total["wait_copy"] += gap_end - gap_start - host
    out = {key: round(value / len(steps), 1) for key, value in total.items()}
    out["pcie_idle"] = round(out["step"] - out["pcie"], 1)
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _clip(spans, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(a, start), min(b, end)) for a, b in spans if b > start and a < end]


def _gaps(busy, start: float, end: float) -> list[tuple[float, float]]:
    """The idle stretches of [start, end] between `busy`'s sorted, disjoint spans."""
    edges = [start] + [t for span in busy for t in span] + [end]
    pairs = zip(edges[::2], edges[1::2], strict=True)
    return [(a, b) for a, b in pairs if b > a]


def _last_before(sorted_times: list[float], t: float) -> float:
    i = bisect.bisect_right(sorted_times, t)
    return sorted_times[i - 1] if i else float("-inf")


def _ends_between(sorted_ends: list[float], low: float, high: float) -> bool:
    i = bisect.bisect_left(sorted_ends, low)
    return i < len(sorted_ends) and sorted_ends[i] <= high
