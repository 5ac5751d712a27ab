"""The rules on samples recorded on the H200 box (2026-12-04, `pytest -m gpu` of the demo and of
tests/diagnose/test_drill_gpu.py): the workload window of each run, stacks expanded, gzipped.

- demo-offload-compiling: the healthy offload run of `ft demo --device cuda`, a 1 s workload
  during which Triton still compiled (new prefill shapes): mostly warm-up.
- demo-hybrid-planted: the demo's broken commit, the planted inline dequantize on the engine
  thread beside a GPU at ~65%, with compilation spans inside the window.
- drill-hybrid-inline / drill-offload: the seed's drill at size (qwen3-30b-a3b, 8-layer cut,
  the seed box's residency and profile, --cpu-moe-inline) and its healthy offload partner.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ft.demo.edits import PLANTED_FUNCTION
from ft.diagnose import findings as rules
from ft.diagnose.summary import summarize

ASSETS = Path(__file__).parents[1] / "assets"
CUDA = {"device": "cuda", "workload": True}
HYBRID = CUDA | {"strategy": "hybrid", "expects_cpu_pool": True}
OFFLOAD = CUDA | {"strategy": "offload", "expects_cpu_pool": False}


def _summary(name: str, context: dict):
    with gzip.open(ASSETS / f"h200-{name}.jsonl.gz", "rt") as f:
        return summarize([json.loads(line) for line in f], context)


def _ids(s) -> list[str]:
    return [f.id for f in rules.findings(s)]


def test_a_window_of_compilation_is_not_a_hot_thread():
    s = _summary("demo-offload-compiling", OFFLOAD)
    engine = next(t for t in s.threads if t.name == "ft-engine")
    assert engine.cpu_pct > 70 and "_do_compile" in " ".join(engine.top_stack)  # it did burn
    assert engine.work_share < 0.5  # ... compiling, which is not its work
    assert _ids(s) == ["warm-up"] and not s.warmup["excluded"]


def test_the_planted_inline_work_is_named_beside_a_busy_gpu_with_compilation_left_out():
    s = _summary("demo-hybrid-planted", HYBRID)
    assert s.gpu.util_pct > 40 and s.warmup["excluded"] and s.warmup["seconds"] > 1
    (hot,) = rules.hot_thread(s)
    assert "thread ft-engine" in hot.title and hot.severity == "critical"
    assert any(PLANTED_FUNCTION in f for f in hot.evidence["hottest_frames"])
    assert not any("_do_compile" in f for f in hot.evidence["work_stack"])
    (idle,) = rules.cpu_pool_idle(s)
    assert idle.evidence["experts_to_cpu"] > 0 and idle.evidence["experts_cpu"] == 0


def test_the_seed_drill_names_the_inline_frames_and_its_offload_partner_is_clean():
    s = _summary("drill-hybrid-inline", HYBRID)
    assert s.gpu.util_pct > 40
    (hot,) = rules.hot_thread(s)
    assert "thread ft-engine" in hot.title
    assert any("_run_inline" in f for f in hot.evidence["work_stack"])
    assert _ids(s)[:2] == ["hot-thread", "cpu-pool-idle"]
    healthy = _summary("drill-offload", OFFLOAD)
    engine = next(t for t in healthy.threads if t.name == "ft-engine")
    assert engine.cpu_pct > 70  # the engine thread is as busy as under hybrid...
    assert "hot-thread" not in _ids(healthy)  # ...issuing the GPU's work, which is not a fault


def test_without_the_counters_an_idle_expected_pool_still_counts_as_starved():
    """A plain `--cmd` run has no engine counters: the idle pool alone decides."""
    s = _summary("drill-hybrid-inline", HYBRID)
    blind = type(s)(**{**s.__dict__, "counters": {}})
    assert rules.hot_thread(blind) and rules.cpu_pool_idle(blind)
    unused = type(s)(**{**s.__dict__, "counters": {**s.counters, "experts_to_cpu": 0}})
    assert not rules.hot_thread(unused) and not rules.cpu_pool_idle(unused)
