"""The CPU MoE executor: exact against a reference FFN, really on its pinned, named threads."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ft import cpuinfo
from ft.engine.cpu.pool import (
    THREAD_PREFIX,
    CpuMoeExecutor,
    ExpertJob,
    expert_jobs,
    format_cores,
    lower_torch_threads,
    ready_line,
    split_range,
)
from ft.errors import FtError

D, INTER, EXPERTS = 64, 48, 6


def ref_moe(x: torch.Tensor, jobs: list[ExpertJob], rounding=None) -> torch.Tensor:
    """The plain fp32 definition: sum over jobs of down(silu(gate x) * up x * weights).
    `rounding`: the pool's rounding of x and of the weighted act (pool.act_rounding), or None."""
    keep = rounding or (lambda v: v)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for job in jobs:
        w13, w2, xs = job.parts["w13"].float(), job.parts["w2"].float(), keep(x[job.rows].float())
        inter = w2.shape[1]
        act = F.silu(xs @ w13[:inter].T) * (xs @ w13[inter:].T) * job.weights[:, None].float()
        out.index_add_(0, job.rows, keep(act) @ w2.T)
    return out


def make_jobs(tokens: int, dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    w13 = (torch.randn(EXPERTS, 2 * INTER, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, D, INTER, generator=gen) / INTER**0.5).to(dtype)
    jobs = []
    for e in range(EXPERTS):
        rows = torch.randperm(tokens, generator=gen)[: max(1, tokens // 2)]
        weights = torch.rand(rows.numel(), generator=gen)
        jobs.append(ExpertJob(parts={"w13": w13[e], "w2": w2[e]}, rows=rows, weights=weights))
    return x, jobs


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("min_slice", [1, 8, 64])
def test_pool_equals_reference_fp32(threads, tokens, min_slice):
    x, jobs = make_jobs(tokens, seed=tokens * 10 + threads)
    with CpuMoeExecutor(threads=threads, min_slice=min_slice) as pool:
        out = pool.submit(x, jobs).wait()
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, ref_moe(x, jobs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "compute,tol", [("float32", 1e-5), ("native", 3e-2), ("compiled", 1e-5), ("auto", 1e-5)]
)  # compiled (auto's for bf16): float32 arithmetic on the bf16 weights, one kernel call a block
def test_pool_bf16_weights(compute, tol):
    x, jobs = make_jobs(5, dtype=torch.bfloat16)
    with CpuMoeExecutor(threads=2, compute=compute, min_slice=4) as pool:
        out = pool.submit(x, jobs).wait()
        rounding = pool.act_rounding("bf16", torch.bfloat16, 5)  # bf16 dot: x, act to bf16
    torch.testing.assert_close(out, ref_moe(x, jobs, rounding), rtol=tol, atol=tol)


def test_auto_multiplies_bf16_weights_with_one_compiled_call_a_block():
    from ft.engine.cpu.compute import describe_compute
    from ft.engine.formats import get_format

    bf16 = get_format("bf16")
    assert describe_compute("auto", bf16, torch.bfloat16) == "compiled float32"
    assert describe_compute("native", bf16, torch.bfloat16) == "native bfloat16"
    assert describe_compute("auto", bf16, torch.float32) == "float32"  # fp32 weights: as before


def test_ffns_ran_on_pool_threads_only():
    x, jobs = make_jobs(4)
    with CpuMoeExecutor(threads=2, min_slice=4) as pool:
        handle = pool.submit(x, jobs)
        handle.wait()
        assert pool.stats.experts_in_pool == EXPERTS
        assert pool.stats.experts_inline == 0
    assert handle.ran_on, "no thread recorded computing the tasks"
    assert all(name.startswith(THREAD_PREFIX) for name in handle.ran_on), handle.ran_on
    assert threading.current_thread().name not in handle.ran_on


def test_rows_of_one_expert_are_split_across_workers():
    x, jobs = make_jobs(1)
    with CpuMoeExecutor(threads=2, min_slice=4, tasks_per_thread=4) as pool:
        handle = pool.submit(x, jobs[:1])
        handle.wait()
        assert pool.stats.experts_in_pool == 1  # one expert, counted once however it is cut
    assert len(split_range(INTER, 8, 4)) == 8


def test_threads_carry_os_name_and_pin():
    cores = cpuinfo.allowed_cores()
    with CpuMoeExecutor(threads=len(cores)) as pool:
        for k, tid in enumerate(pool.native_ids):
            comm = Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text().strip()
            assert comm == f"{THREAD_PREFIX}{k}"
            assert os.sched_getaffinity(tid) == {pool.cores[k]}
        assert pool.cores == cores


def test_close_stops_threads_and_later_work_is_inline(ft_log):
    x, jobs = make_jobs(3)
    pool = CpuMoeExecutor(threads=2)
    workers = list(pool._workers)
    pool.close()
    assert not any(t.is_alive() for t in workers)
    assert {t.name for t in threading.enumerate()}.isdisjoint({t.name for t in workers})
    out = pool.submit(x, jobs).wait()
    torch.testing.assert_close(out, ref_moe(x, jobs), rtol=1e-5, atol=1e-5)
    assert pool.stats.experts_inline == EXPERTS and pool.stats.experts_in_pool == 0
    assert "pool is closed" in ft_log.text


def test_forced_inline_is_counted_and_warned_once(ft_log, monkeypatch):
    monkeypatch.setenv("FT_CPU_MOE_INLINE", "1")
    x, jobs = make_jobs(2)
    with CpuMoeExecutor(threads=1) as pool:
        first = pool.submit(x, jobs)
        pool.submit(x, jobs).wait()
        assert pool.stats.experts_inline == 2 * EXPERTS and pool.stats.experts_in_pool == 0
    assert first.ran_on == {threading.current_thread().name}
    warnings = [r for r in ft_log.records if "outside the pool" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


@pytest.mark.parametrize(
    "compute,error,match",
    [("auto", ValueError, r"part w13: want"), ("float32", RuntimeError, "worker failed")],
)  # the layer kernel reads raw addresses: its submit refuses a bad part; the task path's
# worker fails and hands the error to wait()
def test_bad_part_is_refused_and_pool_survives(compute, error, match):
    x, jobs = make_jobs(2)
    parts = {"w13": torch.randn(2 * INTER, D + 1), "w2": jobs[0].parts["w2"]}
    bad = ExpertJob(parts=parts, rows=jobs[0].rows, weights=jobs[0].weights)
    with CpuMoeExecutor(threads=2, compute=compute) as pool:
        with pytest.raises(error, match=match):
            pool.submit(x, [bad]).wait(timeout=30)
        torch.testing.assert_close(pool.submit(x, jobs).wait(timeout=30), ref_moe(x, jobs))


def test_empty_jobs_give_zeros():
    x, _ = make_jobs(2)
    with CpuMoeExecutor(threads=1) as pool:
        assert torch.equal(pool.submit(x, []).wait(), torch.zeros(2, D))


def test_split_range_covers_exactly():
    for n, parts, min_size in [(640, 5, 32), (48, 100, 1), (10, 4, 32), (7, 3, 2)]:
        blocks = split_range(n, parts, min_size)
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert len(blocks) <= max(parts, 1)


def test_bad_cores_are_a_user_error():
    with pytest.raises(FtError, match="not in this process's allowed cores"):
        CpuMoeExecutor(cores=[10_000])
    with pytest.raises(FtError, match="at least 1"):
        CpuMoeExecutor(threads=0)
    with pytest.raises(FtError, match="compute must be one of"):
        CpuMoeExecutor(threads=1, compute="bf16")


def test_log_lines(ft_log):
    saved = torch.get_num_threads()
    try:
        before, after = lower_torch_threads(pool_threads=1)
    finally:
        torch.set_num_threads(saved)
    assert after <= before and after >= 1
    expected = f"torch intra-op threads: {before} -> {after} (cores reserved for the pinned CPU MoE"
    assert expected in ft_log.text
    with CpuMoeExecutor(threads=1, cores=[cpuinfo.allowed_cores()[0]]) as pool:
        line = ready_line(pool, fmt="bf16", hidden=2560, intermediate=640, experts=512,
                          layers=48, top_k=10)  # fmt: skip
    assert line.startswith("CPU MoE executor ready: threads=1 (pinned to cores ")
    assert line.endswith("fmt=bf16 H=2560 I=640 experts=512 layers=48 top_k=10")
    assert format_cores(list(range(15))) == "0..14" and format_cores([0, 2]) == "0,2"


def test_wait_is_idempotent():
    x, jobs = make_jobs(3)
    with CpuMoeExecutor(threads=2, min_slice=4) as pool:
        handle = pool.submit(x, jobs)
        first = handle.wait().clone()
        assert torch.equal(handle.wait(), first) and handle.done()


def test_workers_have_one_torch_thread_and_leave_the_default_alone():
    before = torch.get_num_threads()
    with CpuMoeExecutor(threads=2) as pool:
        assert pool.worker_torch_threads == [1, 1]
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
    assert torch.get_num_threads() == before and seen == [before]


def test_tensors_off_the_cpu_are_refused_in_the_caller():
    x, jobs = make_jobs(2)
    with CpuMoeExecutor(threads=1) as pool:
        with pytest.raises(ValueError, match="x is on meta"):
            pool.submit(x.to("meta"), jobs)
        bad = ExpertJob(jobs[0].parts, jobs[0].rows.to("meta"), jobs[0].weights)
        with pytest.raises(ValueError, match=r"jobs\[1\].rows is on meta"):
            pool.submit(x, [jobs[0], bad])


def ref_dense_moe(x, w13, w2, topk_ids, topk_weights):
    """Every token through each of its top-k experts, one at a time."""
    out = torch.zeros(x.shape)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist(), strict=True):
            act = F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])
            out[t] += w * (w2[e] @ act)
    return out


def dense_routing(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, D, generator=gen) / D**0.5
    w2 = torch.randn(EXPERTS, D, INTER, generator=gen) / INTER**0.5
    scores = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1)
    topk_weights, topk_ids = scores.topk(3, dim=-1)  # [T, K]
    return x, {"w13": w13, "w2": w2}, topk_ids, topk_weights


@pytest.mark.parametrize("compute", ["auto", "float32"])  # the layer kernel, the row blocks
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_layer_from_its_routing_matches_a_dense_moe(tokens, compute):
    x, bank, topk_ids, topk_weights = dense_routing(tokens)
    jobs = expert_jobs(bank, topk_ids, topk_weights, list(range(EXPERTS)))
    expected = ref_dense_moe(x, bank["w13"], bank["w2"], topk_ids, topk_weights)
    with CpuMoeExecutor(threads=2, min_slice=8, compute=compute) as pool:
        out = pool.submit(x, jobs).wait()
        assert pool.stats.experts_in_pool == len(jobs) == topk_ids.unique().numel()
        routed = pool.submit_routed(x, bank, "bf16", topk_ids, topk_weights, list(range(EXPERTS)))
        torch.testing.assert_close(routed.wait(), expected, rtol=1e-5, atol=1e-5)
        assert pool.stats.experts_in_pool == 2 * len(jobs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("why", ["forced", "closed"])
def test_a_routed_layer_off_the_pool_is_counted_and_warned_once(why, ft_log, monkeypatch):
    if why == "forced":
        monkeypatch.setenv("FT_CPU_MOE_INLINE", "1")
    x, bank, topk_ids, topk_weights = dense_routing(3)
    expected = ref_dense_moe(x, bank["w13"], bank["w2"], topk_ids, topk_weights)
    pool = CpuMoeExecutor(threads=1)
    if why == "closed":
        pool.close()
    for _ in range(2):
        out = pool.submit_routed(x, bank, "bf16", topk_ids, topk_weights, list(range(EXPERTS)))
        torch.testing.assert_close(out.wait(), expected, rtol=1e-5, atol=1e-5)
    pool.close()
    routed = topk_ids.unique().numel()
    assert pool.stats.experts_inline == 2 * routed and pool.stats.experts_in_pool == 0
    warnings = [r for r in ft_log.records if "outside the pool" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
