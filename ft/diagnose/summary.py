"""Pure functions from a sample stream (list of records) to the per-thread and GPU summary."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from statistics import fmean

from ft.probes import threads as roles
from ft.probes.gpu import pcie_link_gbs
from ft.probes.stacks import expand_stacks

AGENT = "ft agent"  # the stack agent's own thread: never a finding
_LINE = re.compile(r":\d+\)$")

# Frames that mean the target is warming up, not decoding: a kernel compiling or a CUDA graph
# being captured. On CUDA an engine's first requests do this for seconds (Triton compiles each
# kernel for each shape), and sampled it reads as the engine thread burning its own work.
WARMUP_FUNCTIONS = frozenset({
    "JITFunction._do_compile",  # Triton
    "Autotuner._bench",  # Triton autotuning runs candidate kernels
    "DecodeGraphs._capture",  # ft: CUDA graph capture of a decode step
    "CUDAGraph.capture_begin",
    "CUDAGraph.capture_end",
    "Dispatcher._compile_for_args",  # numba
})  # fmt: skip
WARMUP_FILES = ("convert_frame.py",)  # torch.compile (dynamo) compiling a frame
_WARMUP_BARE = {"_do_compile", "_compile_for_args", "capture_begin", "capture_end"}  # py-spy

# Leaf frames where a thread waits rather than works: for the GPU (a sync, a copy that waits
# for the stream, the host polling a gate), for the CPU MoE pool, or for requests. A thread at
# 100% CPU in these is polling, and holds nothing back by its own work.
WAIT_FUNCTIONS = frozenset({
    "synchronize", "Event.synchronize", "Stream.synchronize",  # torch.cuda
    "StopRows.wait",  # ft: the host polls the rows a device gate writes
    "DecodeGraphs.logits",  # ft: its input copies wait for the previous step on the stream
    "CpuMoeHandle.wait",  # ft: the engine waits for the CPU MoE pool
    "EngineWorker._drain_inbox",  # ft serve: the engine waits for requests
    "Condition.wait", "Event.wait", "Thread.join", "Queue.get", "SimpleQueue.get",
    "Popen.wait", "Popen._try_wait", "Popen.communicate",
    "BaseSelector.select", "EpollSelector.select", "SelectSelector.select", "select",
    "Runner.run", "BaseEventLoop._run_once", "sleep",
})  # fmt: skip


@dataclass(frozen=True)
class ThreadSummary:
    pid: int
    tid: int
    name: str  # the Python name where the agent knows it, else the OS name (comm)
    comm: str
    role: str
    samples: int
    cpu_pct: float  # mean over the run, % of one core
    cpu_pct_max: float
    r_frac: float  # fraction of samples in state R
    states: dict[str, int]
    cpu_s: float  # accumulated since the thread started (like top's TIME+)
    delay_pct: float  # mean % of the time runnable but waiting for a core
    wchan: str  # the most common wait channel ("0" while running)
    cpus_allowed: str
    ctxt_voluntary: int  # context switches during the run
    ctxt_nonvoluntary: int
    stack_samples: int = 0
    top_stack: list[str] = field(default_factory=list)  # root-first, the most common stack
    top_stack_count: int = 0
    top_functions: list[tuple[str, int]] = field(default_factory=list)  # leaf functions, by samples
    native_stack: list[str] = field(default_factory=list)  # py-spy --native, last dump
    work_share: float | None = None  # of its stack samples, those neither waiting nor warming up
    work_stack: list[str] = field(default_factory=list)  # the most common stack while working

    @property
    def hottest_frames(self) -> list[str]:
        """The leaf-most frames of the most common stack, innermost first."""
        return self.top_stack[::-1][:4]

    @property
    def hottest_work_frames(self) -> list[str]:
        """The leaf-most frames of the most common stack outside waits, innermost first."""
        return self.work_stack[::-1][:4] or self.hottest_frames


@dataclass(frozen=True)
class GpuSummary:
    available: bool
    reason: str | None = None
    name: str | None = None
    samples: int = 0
    util_pct: float | None = None  # mean of the busiest device
    util_pct_max: float | None = None
    mem_used_mib: int | None = None
    mem_total_mib: int | None = None
    sm_clock_mhz: float | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    rx_gbs: float | None = None  # mean host-to-device traffic
    tx_gbs: float | None = None

    @property
    def link_gbs(self) -> float | None:
        return pcie_link_gbs(self.pcie_gen, self.pcie_width)


@dataclass(frozen=True)
class Summary:
    threads: list[ThreadSummary]
    gpu: GpuSummary
    cores: int  # cores the target may run on
    duration_s: float
    stack_source: str | None  # "agent", "py-spy" or None (no stacks)
    stack_samples: int
    events: list[dict]
    context: dict  # from the target: strategy, whether CPU expert work is expected, ...
    window: str = "whole run"  # or "workload": only samples taken while the workload ran
    warmup: dict | None = None  # seconds of warm-up left out, its frames, whether any remained
    counters: dict[str, float] = field(default_factory=dict)  # the engine's, over the workload

    def by_role(self, role: str) -> list[ThreadSummary]:
        return [t for t in self.threads if t.role == role]


def by_kind(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        out[rec.get("kind", "?")].append(rec)
    return out


def workload_window(records: list[dict]) -> tuple[list[dict], bool]:
    """Only the workload's span where the target marks one: an engine's load is not its decode."""
    marks = {r["phase"]: r["t"] for r in records if r.get("kind") == "phase"}
    if "workload" not in marks:
        return records, False
    lo, hi = marks["workload"], marks.get("done", float("inf"))
    timed = ("threads", "gpu", "stacks")
    return [r for r in records if r.get("kind") not in timed or lo <= r["t"] <= hi], True


def is_warmup(frames: list[str]) -> bool:
    return any(
        _name(f) in WARMUP_FUNCTIONS
        or _name(f).rsplit(".", 1)[-1] in _WARMUP_BARE
        or any(f"({file}:" in f or f"/{file}:" in f for file in WARMUP_FILES)
        for f in frames
    )


def is_wait(frames: list[str]) -> bool:
    return bool(frames) and _name(frames[-1]) in WAIT_FUNCTIONS


def _name(frame: str) -> str:
    """'StopRows.wait (graphs.py:110)' -> 'StopRows.wait'."""
    return frame.split(" (", 1)[0]


def steady_state(records: list[dict]) -> tuple[list[dict], dict | None]:
    """The records outside warm-up: every stack sample that compiles or captures marks a span
    (padded by the sampling intervals, since a thread sample covers the interval before it);
    thread, GPU and stack samples inside a span are left out. If fewer than 3 thread samples
    would remain, nothing is left out and the summary says the window was mostly warm-up."""
    stacks = [r for r in records if r.get("kind") == "stacks"]
    hits = sorted(r["t"] for r in stacks if any(is_warmup(th["frames"]) for th in r["threads"]))
    if not hits:
        return records, None
    ticks = [r["t"] for r in records if r.get("kind") == "threads"]
    pad = max(_median_gap(ticks), _median_gap([r["t"] for r in stacks]), 0.1)
    spans: list[list[float]] = []
    for t in hits:
        if spans and t - pad <= spans[-1][1]:
            spans[-1][1] = t + pad
        else:
            spans.append([t - pad, t + pad])
    inside = lambda t: any(lo <= t <= hi + pad for lo, hi in spans)  # noqa: E731
    timed = ("threads", "gpu", "stacks")
    kept = [r for r in records if r.get("kind") not in timed or not inside(r["t"])]
    frames = Counter(
        _name(f)
        for r in stacks
        for th in r["threads"]
        for f in th["frames"]
        if _name(f) in WARMUP_FUNCTIONS
    )
    steady = sum(1 for r in kept if r.get("kind") == "threads") >= 3
    info = {
        "seconds": round(sum(hi - lo for lo, hi in spans), 1),
        "spans": len(spans),
        "frames": [name for name, _ in frames.most_common(3)],
        "excluded": steady,
    }
    return (kept if steady else records), info


def _median_gap(times: list[float]) -> float:
    gaps = sorted(b - a for a, b in pairwise(times) if b > a)
    return gaps[len(gaps) // 2] if gaps else 0.0


def summarize(records: list[dict], context: dict | None = None) -> Summary:
    records, windowed = workload_window(expand_stacks(records))
    records, warmup = steady_state(records)
    kinds = by_kind(records)
    stacks, source = primary_stacks(kinds["stacks"])
    thread_recs = kinds["threads"]
    times = [r["t"] for r in thread_recs]
    threads = _threads(thread_recs, stacks, kinds["agent"], kinds["stacks"])
    threads.sort(key=lambda t: (-t.cpu_pct, t.pid, t.tid))
    return Summary(
        threads=threads,
        gpu=summarize_gpu(kinds["gpu"]),
        cores=_cores(thread_recs, kinds["start"]),
        duration_s=round(max(times) - min(times), 2) if times else 0.0,
        stack_source=source,
        stack_samples=len(stacks),
        events=kinds["event"],
        context=context or next((r.get("context", {}) for r in kinds["start"]), {}),
        window="workload" if windowed else "whole run",
        warmup=warmup,
        counters=next((r.get("counters") or {} for r in kinds["throughput"] if r.get("final")), {}),
    )


def primary_stacks(stacks: list[dict]) -> tuple[list[dict], str | None]:
    """The agent's samples where there are any (frequent, no ptrace), else py-spy's."""
    for source in ("agent", "py-spy"):
        chosen = [r for r in stacks if r.get("source") == source]
        if chosen:
            return chosen, source
    return [], None


def _threads(recs, stacks, agent_hellos, all_stacks) -> list[ThreadSummary]:
    samples: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for rec in recs:
        for th in rec["threads"]:
            samples[(th["pid"], th["tid"])].append(th)
    py_names = {th["tid"]: th["name"] for r in stacks for th in r["threads"] if th.get("tid")}
    agent_tids = {r.get("tid") for r in agent_hellos}
    procs = _procs(recs)
    per_thread_stacks = _stacks_by_tid(stacks)
    native = _last_native(all_stacks)
    out = []
    for (pid, tid), series in samples.items():
        last = series[-1]
        proc = procs.get(pid, {})
        role = (
            AGENT
            if tid in agent_tids
            else roles.classify(last, py_names.get(tid), proc.get("comm"), proc.get("torch", False))
        )
        name = "ft-stack-agent" if role == AGENT else py_names.get(tid)
        out.append(_thread(series, name, role, per_thread_stacks.get(tid, []), native.get(tid, [])))
    return out


def _procs(recs: list[dict]) -> dict[int, dict]:
    procs: dict[int, dict] = {}
    for rec in recs:
        for pid, info in rec.get("procs", {}).items():
            seen = procs.setdefault(int(pid), dict(info))
            seen["torch"] = seen.get("torch", False) or info.get("torch", False)
    return procs


def _thread(series, py_name, role, stacks, native) -> ThreadSummary:
    first, last = series[0], series[-1]
    cpu = [s["cpu_pct"] for s in series if "cpu_pct" in s]
    delay = [s["delay_pct"] for s in series if "delay_pct" in s]
    states = Counter(s["state"] for s in series)
    top_stack, top_count = _top_stack(stacks)
    working = [st for st in stacks if not (is_wait(st) or is_warmup(st))]  # compiling: neither
    return ThreadSummary(
        pid=last["pid"],
        tid=last["tid"],
        name=py_name or last["comm"],
        comm=last["comm"],
        role=role,
        samples=len(series),
        cpu_pct=round(fmean(cpu), 1) if cpu else 0.0,
        cpu_pct_max=round(max(cpu), 1) if cpu else 0.0,
        r_frac=round(states.get("R", 0) / len(series), 2),
        states=dict(states),
        cpu_s=round(last["cpu_s"], 2),
        delay_pct=round(fmean(delay), 1) if delay else 0.0,
        wchan=Counter(s["wchan"] for s in series).most_common(1)[0][0],
        cpus_allowed=last["cpus_allowed"],
        ctxt_voluntary=last["voluntary_ctxt"] - first["voluntary_ctxt"],
        ctxt_nonvoluntary=last["nonvoluntary_ctxt"] - first["nonvoluntary_ctxt"],
        stack_samples=len(stacks),
        top_stack=top_stack,
        top_stack_count=top_count,
        top_functions=Counter(_function(s[-1]) for s in stacks if s).most_common(8),
        native_stack=native,
        work_share=round(len(working) / len(stacks), 2) if stacks else None,
        work_stack=_top_stack(working)[0],
    )


def _function(frame: str) -> str:
    """'spin (busy.py:12)' -> 'spin (busy.py)': lines of one function count together."""
    return _LINE.sub(")", frame)


def _top_stack(stacks: list[list[str]]) -> tuple[list[str], int]:
    if not stacks:
        return [], 0
    counts = Counter(tuple(_function(f) for f in s) for s in stacks)  # lines apart, same code path
    best, count = counts.most_common(1)[0]
    exact = Counter(tuple(s) for s in stacks if tuple(_function(f) for f in s) == best)
    return list(exact.most_common(1)[0][0]), count  # shown with the most common line numbers


def _stacks_by_tid(stacks: list[dict]) -> dict[int, list[list[str]]]:
    out: dict[int, list[list[str]]] = defaultdict(list)
    for rec in stacks:
        for th in rec["threads"]:
            if th.get("tid"):
                out[th["tid"]].append(th["frames"])
    return out


def _last_native(stacks: list[dict]) -> dict[int, list[str]]:
    return {
        th["tid"]: th.get("native", th["frames"])
        for rec in stacks
        if rec.get("source") == "py-spy"
        for th in rec["threads"]
        if th.get("tid")
    }


def _cores(recs: list[dict], starts: list[dict]) -> int:
    for start in starts:
        if start.get("cores"):
            return int(start["cores"])
    allowed = {s["cpus_allowed"] for r in recs for s in r["threads"] if s["tid"] == s["pid"]}
    return max((len(parse_cpulist(a)) for a in allowed), default=1)


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def summarize_gpu(recs: list[dict]) -> GpuSummary:
    usable = [r for r in recs if r.get("available") and r.get("devices")]
    if not usable:
        reason = next((r.get("reason") for r in recs if r.get("reason")), "no GPU samples")
        return GpuSummary(available=False, reason=reason)
    busiest = _busiest_device(usable)
    devs = [d for r in usable for d in r["devices"] if d["index"] == busiest]

    def mean(key, scale=1.0):
        vals = [d[key] for d in devs if d.get(key) is not None]
        return round(fmean(vals) / scale, 2) if vals else None

    last = devs[-1]
    utils = [d["util_pct"] for d in devs if d.get("util_pct") is not None]
    return GpuSummary(
        available=True,
        name=last.get("name"),
        samples=len(devs),
        util_pct=mean("util_pct"),
        util_pct_max=max(utils) if utils else None,
        mem_used_mib=last.get("mem_used_mib"),
        mem_total_mib=last.get("mem_total_mib"),
        sm_clock_mhz=mean("sm_clock_mhz"),
        pcie_gen=last.get("pcie_gen"),
        pcie_width=last.get("pcie_width"),
        rx_gbs=mean("pcie_rx_bytes_s", 1e9),
        tx_gbs=mean("pcie_tx_bytes_s", 1e9),
    )


def _busiest_device(recs: list[dict]) -> int:
    """The device with the most memory in use: the one the target works on."""
    used: Counter = Counter()
    for r in recs:
        for d in r["devices"]:
            used[d["index"]] = max(used[d["index"]], d.get("mem_used_mib") or 0)
    return used.most_common(1)[0][0]
