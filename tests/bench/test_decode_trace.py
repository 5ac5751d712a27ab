"""The device timeline of `ft bench decode --trace`, on hand-made Chrome-trace events."""

from ft.bench.decode_trace import STEP_MARK, device_timeline
from ft.cli.bench_decode import timeline_line


def event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def one_step() -> list[dict]:
    return [
        event("user_annotation", STEP_MARK, 0, 1000),
        event("gpu_user_annotation", STEP_MARK, 5, 990),  # the device's copy of the range
        event("kernel", "attention", 10, 90),  # [10, 100]
        event("cuda_runtime", "cudaGraphLaunch", 150, 5),  # the next stretch queued at 150
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 245),  # lands at 295
        event("kernel", "moe", 300, 100),  # [300, 400], released by the copy
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 410, 5),  # not PCIe H2D
    ]


def test_a_gap_ending_as_a_copy_lands_is_split_at_the_hosts_launch():
    got = device_timeline(one_step())
    assert got["step"] == 1000 and got["compute"] == 190
    # [100, 300]: idle until the launch at 150 (host), then held by the copy (copy)
    assert got["wait_copy"] == 150
    # [0, 10], [100, 150] and the tail [400, 1000] after the step's last kernel
    assert got["wait_host"] == 10 + 50 + 600
    assert got["compute"] + got["wait_copy"] + got["wait_host"] == got["step"]
    assert got["pcie"] == 245 and got["pcie_idle"] == 755


def test_a_gap_with_no_copy_landing_is_the_hosts():
    events = [e for e in one_step() if e["cat"] != "gpu_memcpy"]
    got = device_timeline(events)
    assert got["wait_copy"] == 0 and got["wait_host"] == 810 and got["pcie"] == 0


def test_overlapping_copies_count_once_and_steps_are_averaged():
    second = [dict(e, ts=e["ts"] + 2000) for e in one_step()]
    extra = event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 60, 100)  # inside the first
    got = device_timeline(one_step() + second + [extra])
    assert got["step"] == 1000 and got["pcie"] == 245 and got["wait_copy"] == 150


def test_no_device_activity_gives_no_timeline():
    assert device_timeline([event("user_annotation", STEP_MARK, 0, 10)]) is None
    assert device_timeline([event("kernel", "k", 0, 10)]) is None


def test_the_timeline_prints_as_one_line_in_ms():
    line = timeline_line("offload b1", device_timeline(one_step()))
    assert line == (
        "trace offload b1: step 1.00 ms: GPU computes 0.19 ms, waits for copies 0.15 ms, "
        "for the host 0.66 ms; PCIe copies 0.24 ms (24% of the step)"
    )


def test_the_bench_table_is_followed_by_each_traced_runs_line():
    from rich.console import Console

    from ft.cli.bench_decode import render

    traced = {"strategy": "offload", "batch": 1, "tok_s": 90.0, "kernel": "triton",
              "trace": {"timeline": device_timeline(one_step())}}  # fmt: skip
    untraced = {"strategy": "resident", "batch": 1, "tok_s": 200.0, "kernel": "triton"}
    report = {"model": "m", "device": "cuda", "dtype": "bfloat16", "results": [traced, untraced],
              "bandwidth": {"hbm_gbs": 4000.0, "pcie_gbs": 50.0, "host_gbs": 100.0,
                            "source": {"hbm": "measured"}}}  # fmt: skip
    console = Console(record=True, width=200)
    render(report, console)
    lines = [line for line in console.export_text().splitlines() if line.startswith("trace ")]
    assert lines == [timeline_line("offload b1", traced["trace"]["timeline"])]
