"""The findings rules: pure functions from a Summary to findings with evidence and a next step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ft.diagnose.attach_advice import stacks_advice
from ft.diagnose.summary import AGENT, Summary, ThreadSummary, parse_cpulist
from ft.probes import threads as roles

SEVERITIES = ("critical", "warning", "info")
HOT_CPU_PCT = 70.0  # % of one core: "pinned" with slack for a busy 2-core box
HOT_R_FRAC = 0.5  # fraction of samples in state R
WORK_SHARE = 0.5  # of a hot thread's stack samples outside waits: more work than polling
GPU_IDLE_PCT = 5.0
GPU_LOW_PCT = 30.0
POOL_IDLE_PCT = 5.0  # per pool thread
BUSY_PCT = 50.0  # some other thread doing work, so the pool had work to take
PCIE_BUSY_FRAC = 0.5  # of the link's one-way bandwidth
RUNNABLE_EXCESS = 0.25  # threads waiting for a core on average (schedstat delay), at least


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str
    title: str
    evidence: dict[str, Any]
    next_step: str
    threads: list[int] = field(default_factory=list)  # tids the finding is about

    def to_json(self) -> dict:
        return asdict(self)


def wants_a_core(t: ThreadSummary) -> bool:
    """Running or runnable nearly all the time: CPU % plus the time it waited for a core (a busy
    box delays a spinning thread; schedstat's run delay counts that wait)."""
    return t.cpu_pct + t.delay_pct >= HOT_CPU_PCT


def pool_idle(s: Summary) -> bool:
    return all(t.cpu_pct < POOL_IDLE_PCT for t in s.by_role(roles.POOL))


def gpu_idle(s: Summary) -> bool:
    return not s.gpu.available or (s.gpu.util_pct or 0.0) <= GPU_IDLE_PCT


def _gpu_text(s: Summary) -> str:
    if not s.gpu.available:
        return "the GPU is unavailable"
    return f"GPU utilisation is ~{s.gpu.util_pct:.0f}%"


def _pool_text(s: Summary) -> str:
    pool = s.by_role(roles.POOL)
    if not pool:
        return "there is no CPU MoE pool"
    handed = experts_to_cpu(s)
    but = f" though {handed:.0f} experts were handed to the CPU" if handed else ""
    return f"the CPU MoE pool ({_threads(len(pool))}) is idle{but}"


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _waiting_text(t: ThreadSummary) -> str:
    return f" (+{t.delay_pct:.0f}% runnable, waiting for a core)" if t.delay_pct >= 10 else ""


def _work_text(t: ThreadSummary) -> str:
    return f", {t.work_share:.0%} of its samples in its own work," if t.work_share else ""


def _frames_text(t: ThreadSummary) -> str:
    if t.hottest_work_frames:
        return " <- ".join(t.hottest_work_frames)
    return "unknown (no Python stack: a native thread, or no stack source)"


def experts_to_cpu(s: Summary) -> float | None:
    """Misses the engine handed to the CPU over the workload (its counters), None if unknown."""
    return s.counters.get("experts_to_cpu")


def pool_starved(s: Summary) -> bool:
    """CPU expert work is expected and was handed out, yet the pool does none of it: the work
    went elsewhere. Without the engine's counters (a plain program) an idle expected pool is
    taken as starved."""
    pool = s.by_role(roles.POOL)
    expected = s.context.get("expects_cpu_pool", bool(pool))
    handed = experts_to_cpu(s)
    return expected and pool_idle(s) and (handed is None or handed > 0)


def hot_thread(s: Summary) -> list[Finding]:
    """The seed's: a thread burning a core on its own work while the step waits on it.

    It fires for a thread (not a pool, torch or agent thread) that wants a core
    (CPU % + run delay >= HOT_CPU_PCT: a spinning thread on a busy box waits for its core), is
    in state R in at least HOT_R_FRAC of the samples, and spends at least WORK_SHARE of its
    stack samples outside waits (a thread that polls a device gate or syncs is at 100% CPU
    too, but waiting: told apart by its frames, not its CPU %), when either
    - the GPU (<= GPU_IDLE_PCT) and the CPU MoE pool are both idle: nothing else holds the
      step, or
    - the CPU MoE pool is starved (see pool_starved): work meant for the pool runs elsewhere.
    The GPU's utilisation alone does not clear a thread: under device gates the GPU spins on
    the gate while the host is late, so a partly busy GPU can be waiting on the very thread."""
    if not ((gpu_idle(s) and pool_idle(s)) or pool_starved(s)):
        return []
    if s.context.get("device") == "cpu" and not s.context.get("expects_cpu_pool"):
        return []  # an engine on the CPU device does its "accelerator" work on its own thread
    hot = [
        t
        for t in s.threads
        if t.role not in (roles.POOL, roles.TORCH, AGENT)  # torch workers serve the caller
        and wants_a_core(t)
        and t.r_frac >= HOT_R_FRAC
        and (t.work_share is None or t.work_share >= WORK_SHARE)
    ]
    pool = s.by_role(roles.POOL)
    return [
        Finding(
            id="hot-thread",
            severity="critical" if pool else "warning",
            title=(
                f"thread {t.name} (tid {t.tid}, {t.role}) is in state R at ~{t.cpu_pct:.0f}% CPU"
                f"{_waiting_text(t)}{_work_text(t)} "
                f"while {_gpu_text(s)} and {_pool_text(s)}; "
                f"its hottest frames are {_frames_text(t)}"
            ),
            evidence={
                "tid": t.tid,
                "cpu_pct": t.cpu_pct,
                "run_delay_pct": t.delay_pct,
                "state_r_fraction": t.r_frac,
                "work_share": t.work_share,
                "cpu_s_accumulated": t.cpu_s,
                "wchan": t.wchan,
                "gpu_util_pct": s.gpu.util_pct if s.gpu.available else None,
                "gpu": "available" if s.gpu.available else f"unavailable: {s.gpu.reason}",
                "pool_threads": len(pool),
                "pool_cpu_pct_total": round(sum(p.cpu_pct for p in pool), 1),
                "experts_to_cpu": experts_to_cpu(s),
                "stack_samples": t.stack_samples,
                "hottest_frames": t.hottest_work_frames,
                "work_stack": t.work_stack[::-1][:16],  # innermost first
                "native_leaf_frames": t.native_stack[::-1][:3] or None,  # py-spy --native
            },
            next_step=(
                "Read the hottest frames: work that should run on the GPU or in the CPU MoE pool "
                "is running inline on this thread. Compare with `ft diagnose --strategy offload`, "
                "then `ft bisect GOOD..BAD` to find the commit."
            ),
            threads=[t.tid],
        )
        for t in hot
    ]


def cpu_pool_idle(s: Summary) -> list[Finding]:
    """CPU expert work is expected (hybrid, or a pool exists), others work, the pool does not;
    with the engine's counters, only if experts were handed to the CPU at all (a hybrid that
    fetched every miss leaves its pool idle by design)."""
    pool = s.by_role(roles.POOL)
    busy = [
        t
        for t in s.threads
        if t.role not in (roles.POOL, AGENT) and t.cpu_pct + t.delay_pct >= BUSY_PCT
    ]
    gpu_busy = s.gpu.available and (s.gpu.util_pct or 0.0) >= 20
    if not pool_starved(s) or not (busy or gpu_busy or s.context.get("workload")):
        return []
    where = f"{len(pool)} ft-cpu-moe {_threads(len(pool)).split()[1]} averaged " + (
        f"{max(p.cpu_pct for p in pool):.1f}% CPU at most" if pool else "- none were found"
    )
    counts = s.counters
    handed = (
        f"; {counts['experts_to_cpu']:.0f} experts were handed to the CPU, the pool computed "
        f"{counts.get('experts_cpu', 0):.0f}, {counts.get('experts_cpu_inline', 0):.0f} ran "
        "inline"
        if "experts_to_cpu" in counts
        else ""
    )
    return [
        Finding(
            id="cpu-pool-idle",
            severity="warning",
            title=f"CPU expert work is expected but the CPU MoE pool is idle ({where}){handed}",
            evidence={
                "strategy": s.context.get("strategy"),
                "pool_threads": len(pool),
                "pool_cpu_pct": [p.cpu_pct for p in pool],
                "busy_threads": {t.name: t.cpu_pct for t in busy},
                "gpu_util_pct": s.gpu.util_pct,
                "experts_to_cpu": counts.get("experts_to_cpu"),
                "experts_cpu": counts.get("experts_cpu"),
                "experts_cpu_inline": counts.get("experts_cpu_inline"),
            },
            next_step=(
                "Check that CPU expert jobs reach the pool (executor stats experts_cpu vs "
                "experts_cpu_inline in /metrics); the busy threads' stacks show where the work "
                "went."
            ),
            threads=[p.tid for p in pool],
        )
    ]


def warm_up(s: Summary) -> list[Finding]:
    """Kernel compilation or graph capture inside the sampled window: left out of the other
    findings, and said, so a reader knows what the figures cover."""
    w = s.warmup
    if not w:
        return []
    frames = ", ".join(w["frames"]) or "compile or capture frames"
    if w["excluded"]:
        title = (
            f"{w['seconds']:.1f} s of the window was warm-up ({frames}); those samples are left "
            "out of the other findings"
        )
    else:
        title = (
            f"the window was mostly warm-up ({w['seconds']:.1f} s in {frames}); the findings "
            "use it anyway and may read compilation as work"
        )
    return [
        Finding(
            id="warm-up",
            severity="info" if w["excluded"] else "warning",
            title=title,
            evidence=dict(w),
            next_step=(
                "Nothing, if the steady state is what you want diagnosed."
                if w["excluded"]
                else "Sample longer (more --prompts or --max-tokens, or a longer --duration) so "
                "the steady state outweighs the warm-up."
            ),
        )
    ]


def fetch_bound(s: Summary) -> list[Finding]:
    """The GPU waits on expert weights arriving over PCIe."""
    g = s.gpu
    if not g.available or g.link_gbs is None or g.rx_gbs is None:
        return []
    if (g.util_pct or 0.0) >= GPU_LOW_PCT or g.rx_gbs < PCIE_BUSY_FRAC * g.link_gbs:
        return []
    return [
        Finding(
            id="fetch-bound",
            severity="warning",
            title=(
                f"GPU utilisation is ~{g.util_pct:.0f}% while PCIe host-to-device traffic is "
                f"{g.rx_gbs:.1f} GB/s of the {g.link_gbs:.1f} GB/s "
                f"gen{g.pcie_gen} x{g.pcie_width} link"
            ),
            evidence={
                "gpu_util_pct": g.util_pct,
                "pcie_rx_gbs": g.rx_gbs,
                "pcie_link_gbs": round(g.link_gbs, 2),
                "pcie_gen": g.pcie_gen,
                "pcie_width": g.pcie_width,
            },
            next_step=(
                "Decode is bound by expert fetches: raise the expert cache (--moe-cache-rate), or "
                "let the CPU compute more misses (--moe-strategy hybrid, after `ft bench bw`)."
            ),
        )
    ]


def run_queue_delay(s: Summary) -> list[Finding]:
    """Threads wait for a core (schedstat run delay): more runnable threads than cores, the
    target's own or, when it alone does not fill the cores, other processes'."""
    live = [t for t in s.threads if t.samples > 1]
    running = sum(t.cpu_pct for t in live) / 100
    waiting = sum(t.delay_pct for t in live) / 100
    if waiting < RUNNABLE_EXCESS:
        return []
    own = running + waiting > s.cores
    worst = sorted(live, key=lambda t: -t.delay_pct)[:5]
    cause = "the target's own threads outnumber the cores" if own else "other processes hold cores"
    return [
        Finding(
            id="run-queue-delay",
            severity="warning",
            title=(
                f"threads waited for a core: on average {waiting:.2f} of the target's "
                f"{running + waiting:.1f} runnable threads were waiting, on {s.cores} cores; "
                f"{cause}"
            ),
            evidence={
                "runnable_mean": round(running + waiting, 2),
                "running_mean": round(running, 2),
                "waiting_mean": round(waiting, 2),
                "cores": s.cores,
                "most_delayed": {f"{t.name} ({t.tid})": t.delay_pct for t in worst},
            },
            next_step=(
                "Fewer threads than cores: lower the CPU MoE pool size or torch intra-op threads "
                "(OMP_NUM_THREADS)"
                + ("." if own else "; first stop what else runs on the box (top, by CPU).")
            ),
            threads=[t.tid for t in worst],
        )
    ]


def core_overlap(s: Summary) -> list[Finding]:
    """torch intra-op threads may run on the cores the pinned pool owns, so they compete."""
    pool, torch_threads = s.by_role(roles.POOL), s.by_role(roles.TORCH)
    pool_cores = set().union(*(parse_cpulist(t.cpus_allowed) for t in pool)) if pool else set()
    shared = {t.tid: sorted(parse_cpulist(t.cpus_allowed) & pool_cores) for t in torch_threads}
    shared = {tid: cores for tid, cores in shared.items() if cores}
    if not shared:
        return []
    busy = any(t.cpu_pct >= POOL_IDLE_PCT for t in torch_threads if t.tid in shared)
    return [
        Finding(
            id="core-overlap",
            severity="warning" if busy else "info",
            title=(
                f"{len(shared)} torch intra-op threads may run on the {len(pool_cores)} "
                f"core{'s' if len(pool_cores) > 1 else ''} pinned to the CPU MoE pool"
            ),
            evidence={
                "pool_cores": sorted(pool_cores),
                "torch_threads": len(torch_threads),
                "torch_cpu_pct": {t.tid: t.cpu_pct for t in torch_threads},
                "shared_cores": shared,
            },
            next_step="Keep torch off the pool's cores: torch.set_num_threads(1), or pin it apart.",
            threads=sorted(shared),
        )
    ]


def ptrace_denied(s: Summary) -> list[Finding]:
    """py-spy could not attach; say what the stacks came from instead."""
    denied = [e for e in s.events if e.get("event") == "ptrace-denied"]
    if not denied or (s.context.get("attached") and s.stack_source is None):
        return []  # an attached process without stacks: stacks_unavailable says it, and how
    instead = {
        "agent": "the in-process stack agent (no ptrace needed)",
        "py-spy": "py-spy samples taken before the denial",
    }.get(s.stack_source or "", "nothing: no stacks were gathered")
    return [
        Finding(
            id="ptrace-denied",
            severity="info" if s.stack_source == "agent" else "warning",
            title=f"ptrace is not permitted, py-spy could not attach; stacks came from {instead}",
            evidence={
                "ptrace_scope": s.context.get("ptrace_scope"),
                "py_spy_error": denied[0].get("detail"),
                "stack_source": s.stack_source,
                "stack_samples": s.stack_samples,
            },
            next_step=(
                "Native frames need ptrace: run as the target's parent, or with "
                "`sudo sysctl kernel.yama.ptrace_scope=0`; Python frames need nothing more."
            ),
        )
    ]


def stacks_unavailable(s: Summary) -> list[Finding]:
    """A process ft attached to (`--pid`) gave no Python stacks: why, and what would give them."""
    if not s.context.get("attached") or s.stack_source is not None:
        return []
    why, how, matters = stacks_advice(s.context, s.events)
    pyspy = ("ptrace-denied", "py-spy-failed")
    failed = [e.get("detail") for e in s.events if e.get("event") in pyspy]
    return [
        Finding(
            id="stacks-unavailable",
            severity="warning" if matters else "info",
            title=f"no Python stacks from {why}",
            evidence={
                "ptrace": s.context.get("ptrace"),
                "agent": s.context.get("agent"),
                "agent_folder": s.context.get("agent_folder"),
                "py_spy_error": failed[0] if failed else None,
            },
            next_step=how,
        )
    ]


RULES = (
    hot_thread,
    cpu_pool_idle,
    fetch_bound,
    run_queue_delay,
    core_overlap,
    ptrace_denied,
    stacks_unavailable,
    warm_up,
)


def findings(s: Summary) -> list[Finding]:
    """Every rule's findings, most severe first (rule order within a severity)."""
    found = [f for rule in RULES for f in rule(s)]
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))
