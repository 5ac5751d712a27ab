"""The pool's numba cache follows the package's source, not its path: a second checkout of the
same code loads what the first compiled (a bisect's worktrees, a test's copies), and a change
to a compiled module of the package compiles afresh."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# A small kernel in the package (so the locator takes it) that compiles in well under a second.
PROBE_MODULE = """
from ft.engine.cpu.jit import jit

@jit()
def twice(x):
    return 2 * x
"""

PROBE = """
import json
from ft.engine.cpu import probe_kernel
assert probe_kernel.twice(21) == 42
stats = probe_kernel.twice.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def _checkout(root: Path) -> Path:
    """A copy of ft at `root`, with the probe kernel, and no __pycache__ of this tree."""
    shutil.copytree(REPO_ROOT / "ft", root / "ft",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (root / "ft" / "engine" / "cpu" / "probe_kernel.py").write_text(PROBE_MODULE)
    return root


def _run(tree: Path, cache: Path, **env: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                              "FT_CACHE_DIR": str(cache), **env}, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_second_checkout_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first, second = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    assert _run(first, cache) == {"hits": 0, "misses": 1}
    assert _run(second, cache) == {"hits": 1, "misses": 0}
    assert len(list((cache / "numba").iterdir())) == 1  # one folder for one source

    python_only = _checkout(tmp_path / "c")  # code around the kernels changes: nothing to do
    pool = python_only / "ft" / "engine" / "cpu" / "pool.py"
    pool.write_text(pool.read_text() + "\n# changed\n")
    assert _run(python_only, cache) == {"hits": 1, "misses": 0}

    changed = _checkout(tmp_path / "d")  # a helper of the kernel changes: compile again
    sync = changed / "ft" / "engine" / "cpu" / "sync.py"
    sync.write_text(sync.read_text() + "\n# changed\n")
    assert _run(changed, cache) == {"hits": 0, "misses": 1}
    assert len(list((cache / "numba").iterdir())) == 2


def test_numba_cache_dir_is_where_the_user_puts_it(tmp_path):
    tree, cache, numba_dir = _checkout(tmp_path / "a"), tmp_path / "cache", tmp_path / "nb"
    assert _run(tree, cache, NUMBA_CACHE_DIR=str(numba_dir)) == {"hits": 0, "misses": 1}
    assert [p.name.startswith("cpu-") for p in numba_dir.iterdir()] == [True]
    assert not (cache / "numba").exists()
