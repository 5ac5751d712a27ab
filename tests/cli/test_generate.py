"""`ft generate` as a user runs it: built-in model, text and JSON, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from ft.cli.app import app
from tests.conftest import run_ft


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def last_json(result) -> dict:
    """The --json object: the last line of stdout (older click mixes stderr logs in)."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_builtin_model_is_made_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    first = invoke("generate", "--prompt", "The expert cache", "--max-tokens", "4", "--json")
    assert first.exit_code == 0, first.output
    made = (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns
    second = invoke("generate", "--prompt", "The expert cache", "--max-tokens", "4", "--json")
    assert last_json(second)["token_ids"] == last_json(first)["token_ids"]
    assert (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns == made
    report = last_json(first)
    for key in ("text", "prefill_tok_s", "decode_tok_s", "ttft_s", "cache_hits", "cache_misses"):
        assert key in report
    assert len(report["token_ids"]) <= 4


@pytest.mark.timeout(120)
def test_generate_prints_text_and_startup_lines(synth_tiny):
    model_dir, _ = synth_tiny
    args = ["--model", str(model_dir), "--moe-strategy", "offload", "--moe-cache-auto"]
    proc = run_ft("generate", "--prompt", "The expert", "--max-tokens", "5", *args)
    assert proc.returncode == 0, proc.stderr
    for line in (
        "Resolved config: moe_strategy='offload', expert_format='bf16', device='cpu'",
        "Free memory before loading model: ",
        "MoE experts: bf16 via torch",
        "--moe-cache-auto resolved moe_cache_size=32 (rate 1.000)",
        "Allocating ",
    ):
        assert line in proc.stderr
    assert "tokens (" in proc.stderr


def test_gpu_memory_limit_shrinks_the_auto_cache(synth_tiny):
    model_dir, _ = synth_tiny
    # 1.0008 GiB minus the 1 GiB margin (~0.8 MiB) minus ~0.4 MiB of dense weights and KV
    # leaves room for some but not all of the 32 experts of 24 KiB
    result = CliRunner().invoke(app, [
        "generate", "--model", str(model_dir), "--prompt-ids", "1,2", "--max-tokens", "2",
        "--moe-strategy", "offload", "--moe-cache-auto", "--gpu-memory-limit", "1.0008",
        "--kv-reserve-tokens", "64", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert 1 <= last_json(result)["moe_cache_size"] < 32


def _corrupt(dst):
    shard = sorted(dst.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


def _unknown_arch(dst):
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "spoil, extra, message",
    [
        (None, ["--model", "/nonexistent/model"], "model directory not found"),
        (_corrupt, [], "cannot read checkpoint shard"),
        (_unknown_arch, [], "unsupported architecture"),
        (None, ["--moe-strategy", "offload", "--moe-cache-size", "999"], "larger than the expert"),
    ],
)
def test_bad_input_is_one_line_error(synth_tiny, tmp_path, spoil, extra, message):
    model_dir, _ = synth_tiny
    if spoil:
        model_dir = shutil.copytree(model_dir, tmp_path / "copy")
        spoil(model_dir)
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "1,2", *extra]
    proc = run_ft(*args[:2], *args[2:]) if spoil is None else run_ft(*args)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "x", "--prompt-ids", "1"], "exactly one of"),
        (["--prompt-ids", "1,a"], "comma-separated"),
        (["--prompt-ids", "1", "--moe-strategy", "warp"], "unknown moe_strategy"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1", "--moe-gates"], "--moe-gates is offload's and hybrid's"),
    ],
)
def test_flag_mistakes_in_process(args, message):
    result = invoke("generate", *args)
    assert result.exit_code == 1
    assert message in result.output
