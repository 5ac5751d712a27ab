"""Python environments for engine mode, one per set of declared dependencies.

A commit runs from its own worktree (PYTHONPATH), so it needs no install of its own; it only
needs its dependencies. Where the driver's interpreter already satisfies them (the usual case
across a few dozen commits), that interpreter is used; otherwise a venv keyed by the hash of
the dependency list is made once, seeing the driver's packages (a .pth file) so that only what
changed is installed, and reused by every commit that declares the same dependencies.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import site
import sys
import threading
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from ft.bisect.judge import run_group
from ft.bisect.verdict import Skip

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def dependencies(worktree: Path) -> list[str] | Skip:
    path = worktree / "pyproject.toml"
    if not path.exists():
        return Skip("no pyproject.toml at this commit: cannot tell its dependencies")
    if tomllib is None:
        return Skip("reading pyproject.toml needs Python 3.11 (tomllib)")
    try:
        return sorted(tomllib.loads(path.read_text()).get("project", {}).get("dependencies", []))
    except tomllib.TOMLDecodeError as exc:
        return Skip(f"pyproject.toml does not parse: {exc}")


def unsatisfied(requirements: list[str]) -> list[str]:
    """Requirements the driver's interpreter does not meet (name missing or version outside)."""
    missing = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            missing.append(text)
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(text)
    return missing


def env_key(requirements: list[str]) -> str:
    text = "\n".join([sys.version.split()[0], *requirements])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class EnvCache:
    def __init__(self, root: Path, install_timeout_s: float):
        self.root, self.timeout_s = root, install_timeout_s
        root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def python_for(self, worktree: Path) -> Path | Skip:
        reqs = dependencies(worktree)
        if isinstance(reqs, Skip):
            return reqs
        if not unsatisfied(reqs):
            return Path(sys.executable)
        key = env_key(reqs)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # two workers needing the same new env build it once
            return self._build(self.root / key, reqs)

    def _build(self, venv: Path, reqs: list[str]) -> Path | Skip:
        python = venv / "bin" / "python"
        if (venv / ".ft-ready").exists():
            return python
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *reqs],
        ]
        for k, cmd in enumerate(steps):
            result = run_group(cmd, Path("/"), _plain_env(), self.timeout_s)
            if isinstance(result, Skip):
                return Skip(f"install {result.reason.removeprefix('the command ')}")
            rc, out, err = result
            if rc != 0:
                return Skip(f"install failed (exit {rc}): {(err or out).strip()[-200:]}")
            if k == 0:
                _see_driver_packages(venv)
        (venv / ".ft-ready").write_text("\n".join(reqs) + "\n")
        return python


def _see_driver_packages(venv: Path) -> None:
    """The venv sees the driver's site-packages, so only what differs gets installed."""
    for lib in (venv / "lib").glob("python*/site-packages"):
        paths = [p for p in site.getsitepackages() if Path(p).exists()]
        (lib / "ft-bisect-driver.pth").write_text("\n".join(paths) + "\n")


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
