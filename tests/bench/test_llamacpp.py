"""`ft bench llamacpp`: llama-bench's JSON read back (a real recording of the CPU build on the
tiny GGUF), the --n-cpu-moe budget rule, the pairing and the table; and, where a llama.cpp
build is given, the whole run on the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ft.bench import llamacpp
from ft.bench.llamacpp_compare import CompareConfig, agreeing_prefix, markdown, pair_rows, report
from ft.cli.app import app
from ft.errors import FtError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# two runs of the CPU build on the tiny float32 GGUF, joined: llama-bench -p 0 -n 16 -r 3
# -o json -ngl 99, then the same with -ot exps=CPU
RECORDED = ASSETS / "llama-bench-tiny-cpu.json"
GIB = llamacpp.GIB


def recorded() -> list[dict]:
    return llamacpp.parse_llama_bench(RECORDED.read_text())


def test_the_recorded_llama_bench_json_gives_one_decode_row_per_setting():
    rows = recorded()
    assert len(rows) == 2
    for row in rows:
        assert row["n_prompt"] == 0 and row["n_gen"] == 16
        assert row["avg_ts"] > 0 and len(row["samples_ts"]) == 3
        assert row["model_type"].startswith("qwen3moe")
    assert {r["tensor_buft_overrides"] for r in rows} >= {"exps=CPU"}


def test_prompt_rows_are_left_out_and_bad_json_is_one_error():
    rows = json.loads(RECORDED.read_text())
    prompt = {**rows[0], "n_prompt": 512, "n_gen": 0}
    assert len(llamacpp.parse_llama_bench(json.dumps([prompt, *rows]))) == 2
    with pytest.raises(FtError, match="not JSON"):
        llamacpp.parse_llama_bench("llama-bench: error: unknown argument")
    with pytest.raises(FtError, match="without avg_ts"):
        llamacpp.parse_llama_bench(json.dumps([{"n_gen": 16, "samples_ts": []}]))


def test_expert_tensors_are_told_from_the_router_and_dense_tensors():
    sizes = llamacpp.sizes_of([
        ("token_embd.weight", 100), ("blk.0.ffn_gate_inp.weight", 5),
        ("blk.0.ffn_gate_exps.weight", 10), ("blk.0.ffn_up_exps.weight", 10),
        ("blk.0.ffn_down_exps.weight", 10), ("blk.1.ffn_gate_up_exps.weight", 40),
        ("blk.1.attn_q.weight", 7),
    ])  # fmt: skip
    assert sizes.dense == 112 and sizes.experts == (30, 40) and sizes.total == 182


def test_n_cpu_moe_is_the_fewest_leading_layers_that_fit_the_budget():
    sizes = llamacpp.GgufSizes(dense=1 * GIB, experts=(2 * GIB,) * 4)  # 9 GiB in all
    assert llamacpp.n_cpu_moe(sizes, 100) == 0
    assert llamacpp.n_cpu_moe(sizes, 10) == 0  # 9 + 1 margin
    assert llamacpp.n_cpu_moe(sizes, 9.9) == 1
    assert llamacpp.n_cpu_moe(sizes, 6) == 2  # 1 dense + 1 margin + 2 layers of 2
    assert llamacpp.n_cpu_moe(sizes, 2.5) == 4  # only the dense part fits
    assert llamacpp.n_cpu_moe(sizes, 1.5) is None
    placed = dict(llamacpp.placements(sizes, 6))
    assert placed == {"n-cpu-moe 2": ["-ngl", "99", "--n-cpu-moe", "2"],
                      "exps-cpu": ["-ngl", "99", "-ot", "exps=CPU"]}  # fmt: skip
    assert llamacpp.placements(sizes, None) == [("gpu", ["-ngl", "99"])]


def test_a_float32_checkpoint_is_converted_to_f32_and_int8_faces_q8_0():
    assert llamacpp.gguf_type("bf16", "float32") == "f32"
    assert llamacpp.gguf_type("bf16", "bfloat16") == "bf16"
    assert llamacpp.gguf_type("int8", "bfloat16") == "q8_0"


def _peer(placement: str, ts: float, fmt: str = "bf16") -> dict:
    row = {**recorded()[0], "avg_ts": ts, "stddev_ts": 0.5}
    return {"format": fmt, "gguf_type": llamacpp.GGUF_TYPES[fmt], "placement": placement,
            "args": [], "result": row, "gguf_gib": 1.0}  # fmt: skip


def _ft(run: str, faces: str, ts: float | None, fmt: str = "bf16", error=None) -> dict:
    return {"format": fmt, "group": "g", "run": run, "faces": faces, "tok_s": ts, "error": error}


def test_each_ft_run_faces_its_placement_and_the_budget_runs_face_the_best(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    peers = [_peer("gpu", 100.0), _peer("n-cpu-moe 6", 20.0), _peer("exps-cpu", 25.0),
             _peer("gpu", 80.0, "int8")]  # fmt: skip
    fts = [_ft("resident", "gpu", 90.0), _ft("offload", "best", 50.0),
           _ft("hybrid, fetch 0", "exps-cpu", None, error="out of memory"),
           _ft("resident", "gpu", 160.0, "int8")]  # fmt: skip
    table = pair_rows(peers, fts)
    assert [(t["llamacpp_run"], t["ratio"]) for t in table] == [
        ("gpu", 0.9), ("exps-cpu", 2.0), ("exps-cpu", None), ("gpu", 2.0)]  # fmt: skip
    assert table[3]["llamacpp_type"] == "q8_0"
    cfg = CompareConfig(build="b", model=str(tmp_path), budget_gib=5.8)
    checks = [{"gguf_type": "bf16", "agree": 16, "of": 16}]
    text = markdown(report(cfg, checks, peers, fts))
    assert "| g | offload (bf16) | 50.0 | exps-cpu (bf16) | 25.0 ± 0.5 | 2.00x |" in text
    assert "- (out of memory)" in text and "unquantised checkpoint: bf16 16 of 16." in text


def test_agreement_counts_tokens_before_the_first_difference():
    assert agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreeing_prefix([1, 2], [1, 2]) == 2 and agreeing_prefix([], [1]) == 0


def test_the_source_tree_is_found_from_the_build_cache(tmp_path):
    src, bin_dir = tmp_path / "llama.cpp", tmp_path / "build" / "bin"
    src.mkdir(), bin_dir.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    (bin_dir / "llama-bench").write_text("")
    cache = f"X:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL={src}\n"
    (bin_dir.parent / "CMakeCache.txt").write_text(cache)
    lc = llamacpp.LlamaCpp.at(tmp_path / "build")
    assert lc.source == src and lc.bin == bin_dir and lc.tool("llama-quantize") is None


def test_a_missing_build_or_checkpoint_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["bench", "llamacpp", "--build", str(tmp_path),
                                      "--model", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 1 and "error: " in result.output and "config.json" in result.output
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["bench", "llamacpp", "--build", str(tmp_path),
                                      "--model", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 1 and "no llama-bench" in result.output
    assert "Traceback" not in result.output


BUILD = os.environ.get("FT_LLAMACPP_BUILD")


@pytest.mark.slow
@pytest.mark.skipif(
    not BUILD, reason="needs a llama.cpp build: set FT_LLAMACPP_BUILD to its CMake build folder"
)
def test_the_whole_run_on_the_cpu_with_a_real_build(tmp_path):
    from ft.engine.synth.checkpoint import synth_checkpoint

    model = tmp_path / "tiny"
    synth_checkpoint("tiny", model, layers=2, dtype="float32", seed=1)
    result = CliRunner().invoke(app, [
        "bench", "llamacpp", "--build", BUILD, "--model", str(model), "--device", "cpu",
        "--gpu-memory-limit", "2", "--tokens", "8", "--repetitions", "1", "--warmup", "1",
        "--out", str(tmp_path / "out"), "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    rep = json.loads((tmp_path / "out" / "llamacpp.json").read_text())
    # float32 on both sides: the same model gives the same greedy tokens
    assert [(c["agree"], c["of"]) for c in rep["same_model"]] == [(16, 16)]
    assert {p["placement"] for p in rep["llamacpp"]} == {"gpu", "n-cpu-moe 0", "exps-cpu"}
    assert all(t["ft_tok_s"] > 0 and t["llamacpp_tok_s"] > 0 for t in rep["table"])
    assert (tmp_path / "out" / "llamacpp.md").read_text().startswith("| placement |")


def test_the_ft_runs_are_resident_alone_or_three_calls_under_a_budget():
    from ft.bench.llamacpp_compare import ft_runs

    assert [flags for flags, _ in ft_runs(None)] == [["--strategies", "resident"]]
    calls = ft_runs(5.8)
    assert calls[1][0] == ["--strategies", "offload,hybrid", "--gpu-memory-limit", "5.8"]
    assert calls[2][0][-4:] == ["--moe-hybrid-max-fetch", "0", "--gpu-memory-limit", "5.8"]
    faces = {label: face for _, runs in calls for _, label, face in runs.values()}
    assert faces == {"resident": "gpu", "offload": "best", "hybrid": "best",
                     "hybrid, fetch 0": "exps-cpu"}  # fmt: skip
