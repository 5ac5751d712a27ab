"""Every sample on disk as soon as it is taken.

One versioned JSON record per (commit, patch stack digest, measurement config hash) under
OUT/samples/, rewritten atomically after each sample: a Ctrl-C or kill -9 loses at most the
sample in flight, and a resumed (or repeated) run with the same stack and config reads the
record back instead of measuring again. Samples are appended, never edited. Each sample says
the conditions it was taken under (its worker and --jobs): only samples of the same conditions
are compared (ft/bisect/schedule.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft import __version__, cpuinfo
from ft.bisect.gitrepo import PatchStack
from ft.report import write_json_atomic

RECORD_VERSION = 3  # 2: samples carry `jobs`; 3: `node` (--ray) and the record's `nodes`
READABLE = (2, 3)  # a version 2 record is a version 3 one whose samples have no node
ANY: Any = object()  # a filter that matches every value, None included


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def machine() -> dict[str, Any]:
    """Where the samples were taken (pyperf-style metadata)."""
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpuinfo.model_name(),
        "cores": os.cpu_count(),
        "ft": __version__,
    }


@dataclass(frozen=True)
class Sample:
    value: float
    phase: str  # "search" or "confirm" (confirmation samples are fresh, kept apart)
    worker: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES the worker ran with
    seconds: float
    jobs: int = 1  # measurements running at once on the box when this one was taken
    node: str | None = None  # the Ray node that took it (--ray; the record's `nodes` say more)


class SampleStore:
    def __init__(self, root: Path, stack: PatchStack, config: dict[str, Any]):
        self.dir = root / "samples"
        self.stack = stack
        self.config = config
        self.config_hash = config_hash(config)
        self._machine = machine()
        self._records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def _path(self, commit: str) -> Path:
        return self.dir / f"{commit}-{self.stack.digest()}-{self.config_hash}.json"

    def record(self, commit: str) -> dict[str, Any]:
        with self._lock:
            return self._load(commit)

    def _load(self, commit: str) -> dict[str, Any]:
        if commit not in self._records:
            path = self._path(commit)
            rec = json.loads(path.read_text()) if path.exists() else None
            if not rec or rec.get("version") not in READABLE:
                rec = self._fresh(commit)
            rec["version"] = RECORD_VERSION
            rec.setdefault("nodes", {})
            self._records[commit] = rec
        return self._records[commit]

    def _fresh(self, commit: str) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "kind": "ft-bisect-samples",
            "commit": commit,
            "patch_stack": {"digest": self.stack.digest(), "items": self.stack.describe()},
            "config_hash": self.config_hash,
            "config": self.config,
            "machine": self._machine,
            "applied": [],
            "facts": {},
            "samples": [],
            "nodes": {},
            "skip": None,
        }

    def values(
        self,
        commit: str,
        phase: str | None = None,
        worker: int | None = None,
        jobs: int | None = None,
        node: str | None = ANY,
    ) -> list[float]:
        """The sample values of a commit; None matches any phase, worker or --jobs; `node`
        matches exactly (None: samples taken without --ray) unless it is ANY."""
        wanted = {"phase": phase, "worker": worker, "jobs": jobs}
        return [
            s["value"]
            for s in self.samples(commit, node)
            if all(want is None or s[key] == want for key, want in wanted.items())
        ]

    def samples(self, commit: str, node: str | None = ANY) -> list[dict[str, Any]]:
        return [s for s in self.record(commit)["samples"] if node is ANY or s.get("node") == node]

    def skip_reason(self, commit: str) -> str | None:
        skip = self.record(commit)["skip"]
        return skip["reason"] if skip else None

    def add(
        self,
        commit: str,
        sample: Sample,
        applied: list[str],
        facts: dict,
        node: dict[str, Any] | None = None,
    ) -> None:
        """One more sample; `applied` (the patch stack's notes) and `facts` (what the judge
        saw, e.g. the server's startup lines) describe the checkout it was taken on, `node`
        the Ray node that took it (host, GPU, CPU)."""
        entry = {**sample.__dict__, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

        def change(rec: dict[str, Any]) -> None:
            rec["samples"].append(entry)
            if node is not None and sample.node is not None:
                rec["nodes"][sample.node] = node
            rec["applied"] = applied
            rec["facts"] = facts or rec.get("facts", {})

        self._update(commit, change)

    def mark_skip(self, commit: str, reason: str, worker: int) -> None:
        entry = {"reason": reason, "worker": worker, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._update(commit, lambda rec: rec.__setitem__("skip", entry))

    def clear_skip(self, commit: str) -> None:
        if self.skip_reason(commit):
            self._update(commit, lambda rec: rec.__setitem__("skip", None))

    def _update(self, commit: str, change) -> None:
        with self._lock:
            rec = self._load(commit)
            change(rec)
            write_json_atomic(self._path(commit), rec)
