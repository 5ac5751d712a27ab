"""ruff runs with the suite, so CI keeps the code to the project's lint rules (pyproject.toml)."""

import shutil
import subprocess

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_is_clean():
    proc = subprocess.run(
        ["ruff", "check", "ft", "tests"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
