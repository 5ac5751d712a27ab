"""Run a script with Triton's interpreter (TRITON_INTERPRET=1 must be set before triton.jit
wraps the kernels, so a child process, not this one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_interpreted(script: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
