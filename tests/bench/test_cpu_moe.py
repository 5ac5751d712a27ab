"""`ft bench cpu-moe`: every cell measured and checked against float32 first; bad input is one
line; a pool that computes the wrong thing gives no figure."""

from __future__ import annotations

import json

import pytest
import torch

from ft import cpuinfo
from ft.bench import cpu_moe
from ft.bench.bw_formats import FORMATS
from ft.engine.cpu.pool import CpuMoeExecutor
from ft.errors import FtError
from tests.conftest import run_ft


@pytest.mark.timeout(300)
def test_cli_measures_every_cell_beside_host_read():
    res = run_ft(
        "bench", "cpu-moe", "--formats", "bf16,nvfp4", "--experts-per-call", "1,2",
        "--tokens", "1,2", "--calls", "2", "--store-gib", "0.02", "--threads", "2", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["threads"] == 2 and result["stream_read_gbs"] > 0
    # the caller computes too where a core is left to it; the host read is at as many threads
    helps = len(cpuinfo.allowed_cores()) > 2
    assert result["computing_threads"] == 2 + helps
    cells = {(r["fmt"], r["compute"], r["tokens"], r["experts"]) for r in result["rows"]}
    assert cells == {(f, "auto", t, k) for f in ("bf16", "nvfp4") for t in (1, 2) for k in (1, 2)}
    for r in result["rows"]:
        assert r["gbs"] > 0 and r["max_err"] < 1e-3
        assert 0 < r["submit_us"] < r["us"]  # the caller's side is part of the call
        assert r["of_read"] == pytest.approx(r["gbs"] / result["stream_read_gbs"], abs=1e-3)
        if not helps:
            assert r["caller_units"] == 0


@pytest.mark.parametrize(
    "args,start",
    [(("--formats", "bf16,nvfp5"), "error: --formats"), (("--tokens", "1,x"), "error: --tokens"),
     (("--compute", "fast"), "error: --compute"), (("--peer", "llama"), "error: --peer: unknown")],
)  # fmt: skip
def test_cli_bad_input_is_one_line(args, start):
    res = run_ft("bench", "cpu-moe", *args)
    assert res.returncode == 1 and res.stderr.startswith(start), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_pool_off_the_reference_gives_no_figure(monkeypatch):
    fmt = FORMATS["bf16"]
    _, bank = fmt.make_store(2, cpu_moe.HIDDEN, cpu_moe.INTER, pin=False)
    with CpuMoeExecutor(threads=1) as pool:
        assert cpu_moe._check(pool, fmt, bank, tokens=1) < 1e-3
        wrong = type("Handle", (), {"wait": lambda self: torch.zeros(1, cpu_moe.HIDDEN)})()
        monkeypatch.setattr(pool, "submit_routed", lambda *args: wrong)
        with pytest.raises(FtError, match="differs from float32 torch"):
            cpu_moe._check(pool, fmt, bank, tokens=1)


@pytest.mark.timeout(300)
def test_phases_show_where_each_cells_calls_spend_their_time():
    res = run_ft(
        "bench", "cpu-moe", "--formats", "int8", "--experts-per-call", "2", "--tokens", "1",
        "--calls", "3", "--store-gib", "0.02", "--threads", "2", "--phases",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "pool call phases" in res.stdout and "int8 T=1 k=2" in res.stdout
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), experts_per_call=(2,), tokens=(1,),
                                    calls=3, store_gib=0.02, threads=2, phases=True)  # fmt: skip
    (row,) = cpu_moe.run_cpu_moe(cfg, lambda _: None)["rows"]
    phases = row["phases"]
    assert len(phases["phase 1 by worker_us"]) == 2
    assert 0 < phases["phase 1"]["median_us"] <= phases["phase 1"]["max_us"]
    assert phases["phase 1"]["median_us"] < phases["total"]["median_us"]
    assert phases["total"]["median_us"] <= row["us"]  # the caller's submit is outside it


def test_phases_need_the_layer_kernel():
    res = run_ft("bench", "cpu-moe", "--compute", "native", "--phases", "--store-gib", "0.02")
    assert res.returncode == 1 and res.stderr.startswith("error: --phases"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(300)
def test_calls_whose_caller_ran_on_a_workers_core_are_counted(capsys, monkeypatch):
    """The unpinned caller can land on a pinned worker's core (docs/cpu-pool.md, "Design"): each
    row counts the timed calls it ended on one, and the table says so; where the pool takes every
    core the caller shares one by design, and the row says None."""
    import os
    import threading

    from ft import cpuinfo
    from ft.cli.bench_cpu_moe import _render

    allowed = cpuinfo.allowed_cores()
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), experts_per_call=(1,), tokens=(1,),
                                    calls=3, store_gib=0.01, threads=len(allowed))  # fmt: skip
    (row,) = cpu_moe.run_cpu_moe(cfg, lambda _: None)["rows"]
    assert row["caller_on_worker_core"] is None
    if len(allowed) < 2:
        pytest.skip("one core: every caller shares it")
    me, worker_core = threading.get_native_id(), allowed[0]  # pick_cores: a 1-thread pool's
    # the process's cores stay every core: only this thread is put where the scheduler might
    monkeypatch.setattr(cpuinfo, "allowed_cores", lambda: list(allowed))
    cfg = cpu_moe.CpuMoeBenchConfig(formats=("bf16",), experts_per_call=(1,), tokens=(1,),
                                    calls=3, store_gib=0.01, threads=1)  # fmt: skip
    try:
        os.sched_setaffinity(me, {worker_core})
        on_worker = cpu_moe.run_cpu_moe(cfg, lambda _: None)
        os.sched_setaffinity(me, set(allowed) - {worker_core})
        (apart,) = cpu_moe.run_cpu_moe(cfg, lambda _: None)["rows"]
    finally:
        os.sched_setaffinity(me, set(allowed))
    assert on_worker["rows"][0]["caller_on_worker_core"] == cfg.calls
    assert apart["caller_on_worker_core"] == 0
    _render(on_worker)
    assert "bf16 T=1 k=1: the caller ended 3 timed calls on a pinned worker's core" in (
        capsys.readouterr().out
    )  # fmt: skip
