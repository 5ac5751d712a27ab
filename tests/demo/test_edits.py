"""The demo's scripted edits against the current tree: every anchor is still where it points."""

from __future__ import annotations

import py_compile
import shutil

import pytest

from ft.demo.edits import AFTER, BEFORE, PLANTED, replace
from ft.errors import FtError
from tests.conftest import REPO_ROOT


def test_every_scripted_edit_applies_to_the_current_tree_in_history_order(tmp_path):
    shutil.copytree(REPO_ROOT / "ft", tmp_path / "ft", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    for commit in (*BEFORE, PLANTED, *AFTER):
        for edit in commit.edits:
            edit(tmp_path)  # raises FtError naming the file and anchor that moved
    for path in ("ft/engine/strategies/hybrid.py", "ft/engine/cpu/pool.py", "ft/bench/bw.py"):
        py_compile.compile(str(tmp_path / path), doraise=True)


def test_an_edit_whose_anchor_moved_names_the_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(FtError, match="a.py lacks"):
        replace("a.py", "y = 2", "y = 3")(tmp_path)
