"""The seed's drill at size, on CUDA: qwen3-30b-a3b's real expert shapes (a layer cut), the seed
box's residency and bandwidth profile, the inline fault injected; `ft diagnose --vs offload`
must name the engine thread and its inline frames under hybrid, and nothing hot under offload.

docs/diagnose.md gives the same drill as a command. FT_DRILL_MODEL reuses a synthesised cut;
FT_DRILL_OUT keeps the two report folders (their samples are the CPU tests' fixtures).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import run_ft

PROFILE = Path(__file__).parents[2] / "profiles" / "seed-epyc7302-rtxpro4000-gen3.json"
DRILL = ("--strategy", "hybrid", "--vs", "offload", "--gpu-memory-limit", "24",
         "--moe-cache-rate", "0.152", "--bw-profile", str(PROFILE), "--cpu-moe-inline",
         "--prompts", "4", "--max-tokens", "48")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_seed_drill_at_size_names_the_engine_thread_and_its_inline_frames(tmp_path):
    model = os.environ.get("FT_DRILL_MODEL")
    if not model:
        model = str(tmp_path / "q30-cut")
        synth = run_ft("model", "synth", "--preset", "qwen3-30b-a3b", "--layers", "8",
                       "--out", model, timeout=400)  # fmt: skip
        assert synth.returncode == 0, synth.stderr[-2000:]
    out = Path(os.environ.get("FT_DRILL_OUT") or tmp_path / "drill")
    start = time.monotonic()
    proc = run_ft("diagnose", *DRILL, "--model", model, "--out", str(out), timeout=500)
    print(f"diagnose --vs offload: {time.monotonic() - start:.0f} s")  # for the closing note
    assert proc.returncode == 0, proc.stderr[-3000:]

    hybrid = json.loads((out / "hybrid" / "report.json").read_text())
    offload = json.loads((out / "offload" / "report.json").read_text())
    hot = next(f for f in hybrid["findings"] if f["id"] == "hot-thread")
    assert "thread ft-engine" in hot["title"], hot["title"]
    assert any("_run_inline" in frame for frame in hot["evidence"]["work_stack"])
    assert "cpu-pool-idle" in [f["id"] for f in hybrid["findings"]]
    assert "hot-thread" not in [f["id"] for f in offload["findings"]], offload["findings"]
    tok_s = {r: rep["throughput"]["e2e_decode_tok_s"] for r, rep in
             (("hybrid", hybrid), ("offload", offload))}  # fmt: skip
    print(f"decode tok/s: {tok_s}")
