"""Shared test helpers: run `ft` as a user would, mark GPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def ft_env(**extra: str) -> dict[str, str]:
    """The environment for an `ft` child process: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra)
    return env


def run_ft(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run `python -m ft ARGS` in a child process and capture its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "ft", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=kw.pop("env", None) or ft_env(),
        **kw,
    )


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Profiles and built-in models go to a per-session folder, never the user's cache."""
    cache = tmp_path_factory.getbasetemp() / "ft-cache"
    monkeypatch.setenv("FT_CACHE_DIR", str(cache))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
