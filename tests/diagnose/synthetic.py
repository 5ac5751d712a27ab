"""Synthetic sample streams for the findings rules, as the probes write them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class T:
    """One synthetic thread: its CPU % and run delay % every tick, state, allowed CPUs."""

    tid: int
    comm: str = "python"
    name: str | None = None  # the Python name the agent reports
    cpu: float = 0.0
    delay: float = 0.0
    state: str = "S"
    cpus: str = "0-15"
    frames: list[str] = field(default_factory=list)
    pid: int = 100
    stacks: list[list[str]] | None = None  # one stack per tick, in turn (else `frames` each tick)

    def stack(self, i: int) -> list[str]:
        return self.stacks[i % len(self.stacks)] if self.stacks else self.frames


def stream(threads: list[T], ticks: int = 10, gpu: dict | None = None,
           counters: dict | None = None, **start) -> list[dict]:  # fmt: skip
    """Records as `samples.jsonl` holds them; gpu=None means no NVIDIA GPU; `counters`: the
    engine's counters over the workload, as engine mode's last throughput record holds them."""
    recs: list[dict] = [{"kind": "start", "schema": 1, "t": 0.0, "cores": 16} | start]
    for i in range(ticks):
        t = float(i)
        recs.append({"kind": "threads", "t": t, "threads": [_thread(th, i) for th in threads]})
        recs.append(_gpu(t, gpu))
        stacks = [
            {"tid": th.tid, "name": th.name, "frames": th.stack(i)} for th in threads if th.name
        ]
        if stacks:
            recs.append(
                {"kind": "stacks", "source": "agent", "t": t, "pid": 100, "threads": stacks}
            )
    if counters is not None:
        recs.append({"kind": "throughput", "t": float(ticks), "final": True, "counters": counters})
    return recs


def _thread(th: T, i: int) -> dict:
    rec = {
        "pid": th.pid,
        "tid": th.tid,
        "comm": th.comm,
        "state": th.state,
        "cpu_s": th.cpu / 100 * i,
        "utime_s": th.cpu / 100 * i,
        "stime_s": 0.0,
        "run_delay_s": th.delay / 100 * i,
        "wchan": "0" if th.state == "R" else "futex_do_wait",
        "voluntary_ctxt": i,
        "nonvoluntary_ctxt": 0,
        "cpus_allowed": th.cpus,
    }
    if i:
        rec |= {"cpu_pct": th.cpu, "delay_pct": th.delay}
    return rec


def _gpu(t: float, gpu: dict | None) -> dict:
    if gpu is None:
        return {"kind": "gpu", "t": t, "available": False, "reason": "no NVML", "devices": []}
    device = {"index": 0, "name": "H200", "mem_used_mib": 1000, "mem_total_mib": 140000} | gpu
    return {"kind": "gpu", "t": t, "available": True, "devices": [device]}


def pool(n: int, cpu: float = 0.0, cpus: str = "0-14", first_tid: int = 200) -> list[T]:
    return [
        T(first_tid + k, name=f"ft-cpu-moe-{k}", cpu=cpu, cpus=cpus, frames=["run (pool.py:1)"])
        for k in range(n)
    ]


def engine_main(cpu: float = 99.0, state: str = "R") -> T:
    frames = ["<module> (serve.py:1)", "step (runner.py:9)", "inline_experts (moe.py:42)"]
    return T(100, name="MainThread", cpu=cpu, state=state, frames=frames)
