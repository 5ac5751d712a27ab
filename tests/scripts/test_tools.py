"""The developer tools kept in scripts/, run as a developer runs them, on small settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, ft_env


def run_script(name: str, *args: str, timeout: float = 300) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / name), *args],
        capture_output=True, text=True, env=ft_env(), timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_sweep_runs_every_repeat_variant_and_batch_on_one_load(tmp_path_factory):
    from tests.engine.checkpoints import make_synth_tiny

    model = make_synth_tiny(tmp_path_factory)[0]
    rows = run_script(
        "bench_sweep.py", "--model", str(model), "--device", "cpu", "--strategy", "offload",
        "--batch", "1,2", "--repeats", "2", "--tokens", "2", "--warmup", "1",
        "--cache-rate", "0.5", "--variants", "stops:GATES=0;window:WINDOW=1", "--by-layer",
    )  # fmt: skip
    seen = {(r["repeat"], r["variant"], r["batch"]) for r in rows}
    assert seen == {(k, v, b) for k in (0, 1) for v in ("stops", "window") for b in (1, 2)}
    assert all(r["error"] is None and r["tok_s"] > 0 for r in rows)
    assert all(len(r["by_layer"]["copied"]) == len(r["by_layer"]["misses"]) > 0 for r in rows)


@pytest.mark.gpu
def test_the_expert_kernel_bench_times_each_format_on_cuda():
    rows = run_script(
        "bench_moe_kernels.py", "--formats", "bf16,nvfp4", "--batches", "1",
        "--shapes", "qwen3-30b-a3b", "--iters", "5",
    )  # fmt: skip
    assert {r["fmt"] for r in rows} >= {"bf16", "nvfp4"}


def test_the_h200_llamacpp_script_parses_and_refuses_an_unknown_step(tmp_path):
    script = str(REPO_ROOT / "scripts" / "llamacpp_h200.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    proc = subprocess.run(["bash", script, "deploy"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "the step is build, measure or all" in proc.stdout
    proc = subprocess.run(["bash", script, "build"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "llama.cpp-src.tar.xz" in proc.stdout


def test_the_row_bench_times_each_format_and_token_count_on_its_kernel_path():
    from ft.engine.cpu import layer_kernel

    rows = run_script(
        "bench_cpu_rows.py", "--tokens", "1,3,6", "--cols", "96", "--rows", "8", "--reps", "2",
        "--repeats", "1",
    )  # fmt: skip
    got = {(r["format"], r["tokens"]): r for r in rows}
    formats = ("bf16", "int8", "fp8_block", "nvfp4")
    assert set(got) == {(f, t) for f in formats for t in (1, 3, 6)}
    assert all(r["ns_per_row"] > 0 for r in rows)
    # int8 experts of up to INT_DOT_TOKENS tokens take the integer dot, more the decode
    assert layer_kernel.INT_DOT_TOKENS == 4
    assert got["int8", 1]["path"] == got["int8", 3]["path"] == "integer"
    assert got["int8", 6]["path"] in ("bf16", "float")
    # bf16 rows: the bf16 dot (AVX512-BF16), else the fused float dot of whole steps (AVX2);
    # fp8_block rows of 96 columns are no whole 128-block: never the fused float dot
    k = layer_kernel
    fused = k.f32_fused.py_func(k.BF16, 96)
    assert got["bf16", 1]["path"] == (
        "bf16" if k.bf16_dotted.py_func(k.BF16) else "float-fused" if fused else "float"
    )
    assert got["fp8_block", 1]["path"] in ("bf16", "float")


def test_the_neighbour_bench_times_the_call_with_each_neighbour_and_stops_them():
    import psutil

    from ft import cpuinfo

    if len(cpuinfo.allowed_cores()) < 2:
        pytest.skip("one core: the pool leaves the caller no core of its own")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rows = run_script(
        "bench_caller_neighbour.py", "--calls", "6", "--rounds", "1", "--experts", "2",
        "--store-experts", "8", "--neighbours", "none,spin,yield",
    )  # fmt: skip
    assert [r["neighbour"] for r in rows] == ["none", "spin", "yield"]
    assert all(r["gbs"] > 0 and r["p90_ms"] > 0 for r in rows)
    assert all(sum(r["caller_cpus"].values()) == 6 for r in rows)  # each call's CPU noted
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before  # none left
    script = str(REPO_ROOT / "scripts" / "bench_caller_neighbour.py")
    for args, message in (
        (["--neighbours", "hog"], "unknown neighbour 'hog'"),
        (["--formats", "bf17"], "no CPU pool path for format 'bf17'"),
    ):
        proc = subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, env=ft_env()
        )
        assert proc.returncode == 1 and message in proc.stderr, args
