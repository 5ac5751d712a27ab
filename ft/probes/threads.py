"""Every thread of a process tree from /proc/PID/task/TID, with CPU % between two samples."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
POOL_NAME = re.compile(r"^ft-cpu-moe-\d+$")
SERVER_NAMES = re.compile(r"uvicorn|asyncio|anyio|ThreadPoolExecutor|http", re.IGNORECASE)
TORCH_LIBS = ("libtorch_cpu", "libgomp", "libiomp5", "libomp")

# Roles, as the report and the findings name them.
MAIN, POOL, ENGINE, SERVER, TORCH, OTHER = (
    "main",
    "cpu-moe pool",
    "engine",
    "server",
    "torch intra-op",
    "other",
)


@dataclass(frozen=True)
class ThreadSample:
    """One thread at one instant; counters are cumulative since the thread started."""

    pid: int
    tid: int
    comm: str
    state: str  # R running, S sleeping, D disk wait, T stopped, Z zombie, ...
    cpu_s: float  # run time: schedstat's nanoseconds where present, else utime + stime
    utime_s: float
    stime_s: float
    run_delay_s: float  # time spent runnable but waiting for a core (schedstat)
    wchan: str
    voluntary_ctxt: int
    nonvoluntary_ctxt: int
    cpus_allowed: str  # Cpus_allowed_list, e.g. "0-14"

    def to_json(self) -> dict:
        return asdict(self)


def _read(path: Path) -> str:
    return path.read_text(errors="replace").strip()


def _parse_stat(text: str) -> tuple[str, str, float, float]:
    """(comm, state, utime_s, stime_s); comm may hold spaces and ')', so split at the last ')'."""
    head, _, rest = text.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()  # fields[0] is state (field 3 of stat)
    utime, stime = int(fields[11]), int(fields[12])  # stat fields 14 and 15
    return comm, fields[0], utime / CLK_TCK, stime / CLK_TCK


def _parse_status(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def read_thread(pid: int, tid: int) -> ThreadSample | None:
    """One thread's counters, or None when it vanished (or cannot be read) mid-way."""
    base = Path(f"/proc/{pid}/task/{tid}")
    try:
        comm, state, utime, stime = _parse_stat(_read(base / "stat"))
        status = _parse_status(_read(base / "status"))
        run_ns, delay_ns = _schedstat(base)
        wchan = _wchan(base)
    except (OSError, ValueError, IndexError):
        return None
    cpu_s = run_ns / 1e9 if run_ns is not None else utime + stime
    return ThreadSample(
        pid=pid,
        tid=tid,
        comm=comm,
        state=state,
        cpu_s=cpu_s,
        utime_s=utime,
        stime_s=stime,
        run_delay_s=(delay_ns or 0) / 1e9,
        wchan=wchan,
        voluntary_ctxt=int(status.get("voluntary_ctxt_switches", 0)),
        nonvoluntary_ctxt=int(status.get("nonvoluntary_ctxt_switches", 0)),
        cpus_allowed=status.get("Cpus_allowed_list", ""),
    )


def _schedstat(base: Path) -> tuple[int | None, int | None]:
    try:
        run_ns, delay_ns, _ = _read(base / "schedstat").split()
        return int(run_ns), int(delay_ns)
    except (OSError, ValueError):  # kernels without CONFIG_SCHEDSTATS
        return None, None


def _wchan(base: Path) -> str:
    try:
        return _read(base / "wchan") or "0"
    except OSError:
        return "?"


def process_tree(pid: int) -> list[int]:
    """The target and all its descendants that are alive now."""
    tree = _tree_from_children_files(pid)
    if tree is not None:
        return tree
    try:  # psutil reads every process's parent on the box: tens of ms where there are many
        root = psutil.Process(pid)
        return [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_from_children_files(pid: int) -> list[int] | None:
    """The tree from /proc/PID/task/TID/children (a few reads per process); None where the
    kernel has no such files (CONFIG_PROC_CHILDREN)."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return [] if not os.path.exists(f"/proc/{pid}") else None
    tree, todo = [], [pid]
    while todo:
        proc = todo.pop()
        try:
            tids = os.listdir(f"/proc/{proc}/task")
        except OSError:
            continue  # it exited mid-walk
        tree.append(proc)
        for tid in tids:
            try:
                todo += [int(c) for c in _read(Path(f"/proc/{proc}/task/{tid}/children")).split()]
            except (OSError, ValueError):
                continue
    return sorted(tree, key=lambda p: p != pid)


def sample_tree(pid: int) -> list[ThreadSample]:
    """Every thread of the process tree rooted at pid; threads that vanish are skipped."""
    samples = []
    for proc in process_tree(pid):
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{proc}/task"))
        except OSError:
            continue
        samples += [s for s in (read_thread(proc, tid) for tid in tids) if s is not None]
    return samples


def uses_torch(pid: int) -> bool:
    """Whether torch's (or an OpenMP) runtime is mapped: then its unnamed threads are intra-op."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return False
    return any(lib in maps for lib in TORCH_LIBS)


def classify(sample: dict, py_name: str | None, main_comm: str | None, torch_loaded: bool) -> str:
    """The role of a thread, from its tid, its OS name and its Python name (agent)."""
    name = py_name or sample["comm"]
    if POOL_NAME.match(name) or POOL_NAME.match(sample["comm"]):
        return POOL
    if sample["tid"] == sample["pid"]:
        return MAIN
    if name.startswith("ft-engine"):
        return ENGINE
    if SERVER_NAMES.search(name):
        return SERVER
    if py_name is None and torch_loaded and sample["comm"] in (main_comm, "pt_main_thread"):
        return TORCH  # OpenMP / torch pool workers inherit the creator's name and are not Python
    return OTHER


class ThreadProbe:
    """Samples a process tree; each record carries CPU % since the previous sample."""

    def __init__(self, pid: int):
        self.pid = pid
        self._last: dict[int, tuple[float, ThreadSample]] = {}
        self._torch: set[int] = set()  # processes seen with torch loaded (it is never unloaded)

    def sample(self) -> dict:
        now = time.monotonic()
        threads = []
        for s in sample_tree(self.pid):
            rec = s.to_json()
            prev = self._last.get(s.tid)
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                rec["cpu_pct"] = round(max(0.0, s.cpu_s - prev[1].cpu_s) / dt * 100, 2)
                rec["delay_pct"] = round(
                    max(0.0, s.run_delay_s - prev[1].run_delay_s) / dt * 100, 2
                )
            threads.append(rec)
            self._last[s.tid] = (now, s)
        return {
            "kind": "threads",
            "t": time.time(),
            "threads": threads,
            "procs": self._procs(threads),
        }

    def _procs(self, threads: list[dict]) -> dict[str, dict]:
        procs = {}
        for rec in threads:
            if rec["tid"] != rec["pid"]:
                continue
            if rec["pid"] not in self._torch and uses_torch(rec["pid"]):
                self._torch.add(rec["pid"])
            procs[str(rec["pid"])] = {"comm": rec["comm"], "torch": rec["pid"] in self._torch}
        return procs
