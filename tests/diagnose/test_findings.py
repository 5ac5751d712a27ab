"""Each findings rule as a pure function over synthetic samples: it fires, and it stays quiet."""

from ft.diagnose import findings as rules
from ft.diagnose.summary import summarize
from tests.diagnose.synthetic import T, engine_main, pool, stream


def ids(records, **context) -> list[str]:
    return [f.id for f in rules.findings(summarize(records, context))]


def test_hot_thread_names_thread_state_and_frames():
    s = summarize(stream([engine_main(), *pool(15)], gpu={"util_pct": 0}))
    (f,) = rules.hot_thread(s)
    assert f.severity == "critical" and f.threads == [100]
    assert "state R" in f.title and "~99% CPU" in f.title and "GPU utilisation is ~0%" in f.title
    assert "CPU MoE pool (15 threads) is idle" in f.title
    assert f.title.endswith(
        "inline_experts (moe.py:42) <- step (runner.py:9) <- <module> (serve.py:1)"
    )
    assert f.evidence["pool_cpu_pct_total"] == 0.0


def test_hot_thread_quiet_when_gpu_busy_or_pool_works_or_thread_sleeps():
    busy = {"util_pct": 80}
    offload = summarize(stream([engine_main(), *pool(4)], gpu=busy), {"expects_cpu_pool": False})
    assert not rules.hot_thread(offload)  # nothing meant for the pool: the GPU is the work
    unused = stream([engine_main(), *pool(4)], gpu=busy, counters={"experts_to_cpu": 0})
    assert not rules.hot_thread(summarize(unused))  # a hybrid that fetched every miss
    assert not rules.hot_thread(summarize(stream([engine_main(), *pool(4, cpu=90)])))
    assert not rules.hot_thread(summarize(stream([engine_main(cpu=3, state="S"), *pool(4)])))


def test_hot_thread_names_the_inline_work_while_the_gpu_is_partly_busy():
    """The seed's drill on CUDA: the GPU at 43%, the pool idle though experts were handed to
    the CPU, the engine thread computing them inline between polls of the device gates."""
    inline = ["<module> (serve.py:1)", "step (runner.py:9)", "_cpu_experts (hybrid.py:140)",
              "FloatFormat.dequantize (floating.py:29)"]  # fmt: skip
    polling = ["<module> (serve.py:1)", "step (runner.py:9)", "StopRows.wait (graphs.py:110)"]
    engine = T(100, name="ft-engine", cpu=95, state="R", stacks=[inline, inline, polling])
    counts = {"experts_to_cpu": 4000, "experts_cpu": 0, "experts_cpu_inline": 0}
    s = summarize(stream([engine, *pool(15)], gpu={"util_pct": 43}, counters=counts))
    (f,) = rules.hot_thread(s)
    assert f.evidence["work_share"] == 0.7 and f.evidence["experts_to_cpu"] == 4000
    assert f.evidence["hottest_frames"][0] == "FloatFormat.dequantize (floating.py:29)"
    assert "GPU utilisation is ~43%" in f.title and "4000 experts were handed to the CPU" in f.title
    (idle,) = rules.cpu_pool_idle(s)
    assert "4000 experts were handed to the CPU, the pool computed 0, 0 ran inline" in idle.title


def test_a_thread_polling_the_gpu_is_waiting_not_working():
    """Under device gates the engine thread spins at 100% CPU on the gate's rows: waiting."""
    gate = ["<module> (serve.py:1)", "step (runner.py:9)", "StopRows.wait (graphs.py:110)"]
    sync = ["<module> (serve.py:1)", "step (runner.py:9)", "synchronize (__init__.py:1083)"]
    engine = T(100, name="ft-engine", cpu=99, state="R", stacks=[gate, gate, sync, gate])
    s = summarize(stream([engine, *pool(15)], gpu={"util_pct": 40}))
    assert s.threads[0].work_share == 0.0
    assert not rules.hot_thread(s)
    assert not rules.hot_thread(summarize(stream([engine, *pool(15)], gpu={"util_pct": 0})))


def test_warm_up_samples_are_left_out_and_reported():
    """Triton compiling in the window read as the engine thread burning (offload on CUDA)."""
    compile_ = ["<module> (serve.py:1)", "step (runner.py:9)",
                "JITFunction._do_compile (jit.py:700)", "make_llir (compiler.py:300)"]  # fmt: skip
    decode = ["<module> (serve.py:1)", "step (runner.py:9)", "synchronize (__init__.py:1083)"]
    warm = stream([T(100, name="ft-engine", cpu=99, state="R", frames=compile_)], ticks=4)
    steady = stream([T(100, name="ft-engine", cpu=30, state="S", frames=decode)], ticks=12)
    for rec in steady:
        rec["t"] = rec.get("t", 0.0) + 4
    s = summarize(warm + steady[1:], {"expects_cpu_pool": False})
    assert s.warmup["excluded"] and s.warmup["frames"] == ["JITFunction._do_compile"]
    assert s.threads[0].cpu_pct == 30.0  # only the steady state's samples
    assert not rules.hot_thread(s)
    (f,) = rules.warm_up(s)
    assert f.severity == "info" and "left out" in f.title
    only_warm = summarize(stream([T(100, name="ft-engine", cpu=99, state="R", frames=compile_)]))
    (g,) = rules.warm_up(only_warm)
    assert g.severity == "warning" and not only_warm.warmup["excluded"]
    assert only_warm.threads[0].cpu_pct == 99.0  # kept: nothing else to diagnose
    assert only_warm.threads[0].work_share == 0.0 and not rules.hot_thread(only_warm)


def test_hot_pool_thread_is_not_the_seed_pattern():
    s = summarize(
        stream([engine_main(cpu=2, state="S"), T(300, name="ft-cpu-moe-0", cpu=99, state="R")])
    )
    assert not rules.hot_thread(s)


def test_first_finding_is_the_seeds():
    assert ids(stream([engine_main(), *pool(15)], gpu={"util_pct": 0}))[0] == "hot-thread"


def test_cpu_pool_idle_when_expected_and_others_work():
    assert "cpu-pool-idle" in ids(stream([engine_main(), *pool(4)]))
    assert "cpu-pool-idle" not in ids(stream([engine_main(), *pool(4, cpu=60)]))
    assert "cpu-pool-idle" not in ids(stream([engine_main(cpu=1, state="S"), *pool(4)]))  # no work


def test_cpu_pool_idle_not_expected_under_offload_even_with_a_pool():
    assert "cpu-pool-idle" not in ids(stream([engine_main(), *pool(4)]), expects_cpu_pool=False)


def test_cpu_pool_idle_when_hybrid_has_no_pool_at_all():
    recs = stream([engine_main(cpu=1, state="S")], gpu={"util_pct": 60})
    (f,) = rules.cpu_pool_idle(summarize(recs, {"expects_cpu_pool": True, "strategy": "hybrid"}))
    assert f.evidence["pool_threads"] == 0 and "none were found" in f.title


def test_fetch_bound_needs_idle_gpu_and_busy_link():
    busy_link = {"util_pct": 8, "pcie_gen": 3, "pcie_width": 16, "pcie_rx_bytes_s": 12e9}
    (f,) = rules.fetch_bound(summarize(stream([engine_main(cpu=5)], gpu=busy_link)))
    assert f.evidence["pcie_link_gbs"] == 15.76 and f.evidence["pcie_rx_gbs"] == 12.0
    quiet_link = busy_link | {"pcie_rx_bytes_s": 1e9}
    assert not rules.fetch_bound(summarize(stream([engine_main(cpu=5)], gpu=quiet_link)))
    busy_gpu = busy_link | {"util_pct": 90}
    assert not rules.fetch_bound(summarize(stream([engine_main(cpu=5)], gpu=busy_gpu)))
    assert not rules.fetch_bound(summarize(stream([engine_main(cpu=5)])))  # no GPU


def test_run_queue_delay_when_runnable_threads_exceed_cores():
    crowd = [T(400 + k, cpu=50, delay=50, state="R") for k in range(4)]
    (f,) = rules.run_queue_delay(summarize(stream(crowd, cores=2)))
    assert f.evidence["cores"] == 2 and f.evidence["runnable_mean"] == 4.0
    assert f.evidence["waiting_mean"] == 2.0 and "target's own threads" in f.title
    (other,) = rules.run_queue_delay(summarize(stream(crowd, cores=16)))
    assert "other processes hold cores" in other.title
    calm = [T(400 + k, cpu=50, state="R") for k in range(4)]
    assert not rules.run_queue_delay(summarize(stream(calm, cores=2)))


def test_core_overlap_between_torch_workers_and_pool_cores():
    torch_worker = T(500, comm="python", cpu=30, cpus="0-15")  # no Python name: an OpenMP worker
    recs = stream([engine_main(), torch_worker, *pool(2, cpus="0-14")])
    recs[1]["procs"] = {"100": {"comm": "python", "torch": True}}
    (f,) = rules.core_overlap(summarize(recs))
    assert f.severity == "warning" and f.evidence["shared_cores"][500] == list(range(15))
    apart = stream([engine_main(), T(500, cpus="15"), *pool(2, cpus="0-14")])
    apart[1]["procs"] = {"100": {"comm": "python", "torch": True}}
    assert not rules.core_overlap(summarize(apart))


def test_ptrace_denied_says_what_was_used_instead():
    recs = stream([engine_main()])
    recs.append({"kind": "event", "event": "ptrace-denied", "detail": "Permission Denied"})
    (f,) = rules.ptrace_denied(summarize(recs, {"ptrace_scope": 1}))
    assert "in-process stack agent" in f.title and f.evidence["ptrace_scope"] == 1
    assert f.severity == "info"
    assert not rules.ptrace_denied(summarize(stream([engine_main()])))


def test_everything_idle_has_no_findings():
    assert ids(stream([engine_main(cpu=0.5, state="S"), *pool(4)], gpu={"util_pct": 0})) == []


def test_a_starved_spinning_thread_is_still_hot():
    starved = T(100, name="MainThread", cpu=40, delay=58, state="R", frames=["spin (x.py:1)"])
    (f,) = rules.hot_thread(summarize(stream([starved, *pool(2)])))
    assert "+58% runnable, waiting for a core" in f.title
    sleepy = T(100, name="MainThread", cpu=40, delay=0, state="R")
    assert not rules.hot_thread(summarize(stream([sleepy, *pool(2)])))


def test_only_the_workload_window_counts():
    loading = stream([engine_main(), *pool(2)], ticks=6)  # hot while it loads the model
    serving = stream([engine_main(cpu=2, state="S"), *pool(2, cpu=40)], ticks=6)
    for rec in serving:
        rec["t"] = rec.get("t", 0.0) + 100
    marks = [{"kind": "phase", "t": 100.0, "phase": "workload"}]
    s = summarize(loading + marks + serving[1:])
    assert s.window == "workload" and not rules.hot_thread(s)
    assert s.threads[0].cpu_pct == 40 and s.by_role("main")[0].cpu_pct == 2
    whole = summarize(loading + serving[1:])  # unmarked: the load's samples count too
    assert whole.window == "whole run" and whole.by_role("main")[0].cpu_pct > 40


def test_cpu_device_engine_thread_is_not_the_seed_pattern_unless_hybrid():
    recs = stream([engine_main()])
    assert not rules.hot_thread(summarize(recs, {"device": "cpu"}))
    hybrid = {"device": "cpu", "expects_cpu_pool": True}
    assert rules.hot_thread(summarize(stream([engine_main(), *pool(2)]), hybrid))
