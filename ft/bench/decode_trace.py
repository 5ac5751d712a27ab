"""`ft bench decode --trace DIR`: where a decode step's time goes. After a (strategy, batch) is
timed, a few more decode steps run under torch.profiler (so the timed figures carry no profiler
overhead); DIR gets a Chrome trace (chrome://tracing, Perfetto) and a table of ops by self
time, host and device, plus the launches per step."""

from __future__ import annotations

from pathlib import Path

from torch.profiler import ProfilerActivity, profile

TRACE_STEPS = 4
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def trace_decode(engine, prompts: list[list[int]], out_dir: Path, name: str) -> dict:
    """Prefill `prompts`, then profile TRACE_STEPS decode steps; -> file paths and counts."""
    from ft.engine.sampling import SamplingParams

    out_dir.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=TRACE_STEPS + 2, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # prefill, not traced
    engine.step()  # one decode step to settle caches
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(TRACE_STEPS):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    trace, table = out_dir / f"{name}.trace.json", out_dir / f"{name}.ops.txt"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    table.write_text(averages.table(sort_by=sort, row_limit=40))
    cuda = engine.device.type == "cuda"
    launches = sum(e.count for e in averages if e.key in LAUNCHES) if cuda else None
    return {"trace": str(trace), "ops": str(table), "steps": TRACE_STEPS,
            "launches_per_step": None if launches is None else launches / TRACE_STEPS}  # fmt: skip
