"""What runs on a Ray node under `ft bisect --ray`: one worker, as a Ray actor.

A worker lives on one node for as long as that node does, holding the resources of one
measurement (a GPU in engine mode, --cpus-per-job cores with --run). It is an actor, not a task
per sample, because engine mode keeps a commit's server up between its samples, as a local
worker does. The code comes from the driver as a git bundle through Ray's object store, so a node
needs no access to the user's repository; everything it builds stays in a per-node cache:

    $FT_CACHE_DIR/bisect/ray/NODE/repos/BUNDLE-DIGEST.git   the bundle, cloned once per node
    $FT_CACHE_DIR/bisect/ray/NODE/runs/RUN/                 a run's worktrees and patches
    $FT_CACHE_DIR/bisect/ray/NODE/envs/KEY/                 environments keyed as locally

This module imports no Ray at the top: the driver wraps `NodeWorker` with `ray.remote`.
"""

from __future__ import annotations

import fcntl
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ft import __version__, cpuinfo, settings
from ft.bisect.gitrepo import PatchStack, Scratch, UserRepo
from ft.bisect.judge import kill_active
from ft.bisect.judges import make_judge
from ft.bisect.verdict import Skip


def node_identity() -> dict[str, Any]:
    """Who measures: enough to tell two machines apart in a report."""
    import ray

    gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    return {
        "host": platform.node(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu": _gpu_name(gpu_ids),
        "cpu": cpuinfo.model_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "ft": __version__,
        "ray": ray.__version__,
    }


def _gpu_name(gpu_ids: list[str]) -> str | None:
    if not gpu_ids:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu_ids[0]))
            name = pynvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver: the id is all there is to say
        return f"GPU {gpu_ids[0]}"


@contextmanager
def _locked(path: Path):
    """Workers of one node share its cache: one of them sets a folder up at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class NodeWorker:
    """One worker's trees on this node: checkout, install, measure, release."""

    def __init__(
        self,
        node: str,
        worker: int,
        bundle: bytes,
        digest: str,
        run_key: str,
        base: str,
        picks: tuple[str, ...],
        patches: list[tuple[str, bytes]],
        opts: Any,  # driver.BisectOptions
        omp_threads: str | None,  # the driver's OMP_NUM_THREADS
    ):

        self.worker = worker
        # Ray sets OMP_NUM_THREADS to the CPUs an actor holds (1 for a GPU worker): right for a
        # --run command held to --cpus-per-job, wrong for a server that is measured as the
        # user runs it. Engine mode gets what the driver has, or nothing.
        self.omp_threads = omp_threads if opts.run is None else os.environ.get("OMP_NUM_THREADS")
        root = settings.cache_dir() / "bisect" / "ray" / _safe(node)
        repo = root / "repos" / f"{digest}.git"
        run = root / "runs" / run_key
        with _locked(root / "lock"):
            if not (repo / "HEAD").exists():
                path = root / "repos" / f"{digest}.bundle"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(bundle)
                UserRepo.clone_bundle(path, repo)
                path.unlink()
            files = []
            for name, data in patches:
                dst = run / "patches" / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
                files.append(dst)
            self.scratch = Scratch(UserRepo(repo), run, base)
        self.stack = PatchStack(picks, tuple(files))
        self.judge = make_judge(opts, cache=root / "envs")
        self._heads: dict[int, tuple[str, list[str]]] = {}

    def identity(self) -> dict[str, Any]:
        return node_identity()

    def measure(self, sha: str, tree: int) -> dict[str, Any]:
        """One sample of `sha` on this worker's tree `tree`: its value and what describes it,
        or why it could not be taken (`install`: the failure may be this node's alone)."""
        path = self.scratch.worktree(f"{self.worker}-{tree}")
        if self._heads.get(tree, ("",))[0] != sha:
            self.judge.release(path)
            notes = self.scratch.checkout(path, sha, self.stack)
            if isinstance(notes, Skip):
                self._heads.pop(tree, None)
                return {"skip": notes.reason, "install": False}
            self._heads[tree] = (sha, notes)
        envs = getattr(self.judge, "envs", None)  # engine mode: the commit's dependencies
        python = envs.python_for(path) if envs is not None else None
        if isinstance(python, Skip):
            return {"skip": python.reason, "install": True}
        env = dict(os.environ, FT_BISECT_COMMIT=sha, FT_BISECT_WORKER=str(self.worker))
        env.pop("OMP_NUM_THREADS", None)
        if self.omp_threads is not None:
            env["OMP_NUM_THREADS"] = self.omp_threads
        start = time.monotonic()
        value = self.judge.measure(path, env)
        if isinstance(value, Skip):
            return {"skip": value.reason, "install": False}
        return {
            "value": value,
            "seconds": round(time.monotonic() - start, 3),
            "applied": self._heads[tree][1],
            "facts": self.judge.describe(path),
            "gpu": os.environ.get("CUDA_VISIBLE_DEVICES") or None,
        }

    def release(self, tree: int) -> None:
        if tree in self._heads:
            self.judge.release(self.scratch.worktree(f"{self.worker}-{tree}"))

    def stop(self) -> None:
        """Ctrl-C at the driver: end what this worker runs (its commands, its servers)."""
        kill_active()
        for tree in list(self._heads):
            self.release(tree)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
