"""The bandwidth profile's rules on the seed's numbers, its checks, and `ft profile show`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ft.errors import FtError
from ft.profile import apply_rules, check, decide, fetch_log_line, load_profile
from tests.conftest import REPO_ROOT, ft_env, run_ft

SEED_PROFILE = REPO_ROOT / "profiles" / "seed-epyc7302-rtxpro4000-gen3.json"


@pytest.fixture
def seed() -> dict:
    return json.loads(SEED_PROFILE.read_text())


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "p.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_seed_profile_decisions():
    profile = load_profile(SEED_PROFILE)
    got = {fmt: decide(profile, fmt) for fmt in profile.formats}
    assert got["bf16"].recommended == "hybrid" and round(got["bf16"].ratio, 3) == 2.352
    assert got["nvfp4"].recommended == "hybrid" and round(got["nvfp4"].ratio, 2) == 2.29
    assert got["ds_fp4"].recommended == "hybrid" and round(got["ds_fp4"].ratio, 3) == 2.329
    assert (
        got["mxfp4_triton"].recommended == "offload" and round(got["mxfp4_triton"].ratio, 2) == 1.38
    )
    assert got["fp8_block"].recommended == "offload" and got["fp8_block"].ratio is None
    assert got["fp8_block"].note == "CPU MoE has no fp8_block weight path; hybrid unavailable"
    assert f"{got['nvfp4'].fetch_fraction:.1%}" == "27.8%"
    assert profile.data["dtypes"] == {fmt: d.recommended for fmt, d in got.items()}


def test_design_example_and_threshold(seed):
    nvfp4 = seed["dtype_kernels"]["nvfp4"]
    assert (nvfp4["cpu_moe_gbs"], nvfp4["pcie_gather_gbs"]) == (29.97, 13.09)  # quoted as is
    assert (nvfp4["cpu_moe_overlap_gbs"], nvfp4["pcie_gather_overlap_gbs"]) == (21.89, 8.41)
    seed["threshold"] = 2.3
    assert decide(seed, "nvfp4").recommended == "offload"
    seed["threshold"] = 2.28
    assert decide(seed, "nvfp4").recommended == "hybrid"


def test_offload_with_a_note_when_numbers_are_missing(seed):
    kernel = seed["dtype_kernels"]["bf16"]
    kernel["pcie_gather_gbs"] = kernel["note"] = None
    d = decide(seed, "bf16")
    assert d.recommended == "offload" and d.ratio is None and "PCIe" in d.note
    missing = decide(seed, "int8")
    assert missing.recommended == "offload" and "no 'int8' entry" in missing.note


def test_apply_rules_fills_ratio_recommended_and_dtypes(seed):
    data = copy.deepcopy(seed)
    for kernel in data["dtype_kernels"].values():
        kernel["ratio"], kernel["recommended"] = None, "offload"
    data["dtypes"] = {}
    apply_rules(data)
    check(data)
    assert data["dtypes"] == seed["dtypes"]
    assert data["dtype_kernels"]["bf16"]["ratio"] == 2.352


def _drop(data: dict, dotted: str) -> dict:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    del node[leaf]
    return data


@pytest.mark.parametrize(
    "field",
    ["threshold", "cpu.isa", "ceilings.pcie_linear_h2d_gbs", "dtype_kernels.bf16.cpu_moe_gbs"],
)
def test_missing_field_is_named(tmp_path, seed, field):
    with pytest.raises(FtError, match=f"missing field '{field}'"):
        load_profile(write(tmp_path, _drop(seed, field)))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(threshold="2"), "field 'threshold' should be number"),
        (lambda d: d.update(version=3), "field 'version' is 3, expected 4"),
        (
            lambda d: d["dtype_kernels"]["bf16"].update(cpu_moe_gbs=True),
            "dtype_kernels.bf16.cpu_moe_gbs",
        ),
        (
            lambda d: d["dtypes"].update(bf16="fast"),
            "field 'dtypes.bf16' should be 'hybrid' or 'offload'",
        ),
        (lambda d: d.update(gpu=[1]), "field 'gpu' should be object or null"),
    ],
)
def test_wrong_values_are_named(tmp_path, seed, mutate, message):
    mutate(seed)
    with pytest.raises(FtError, match=message.replace("(", r"\(")):
        load_profile(write(tmp_path, seed))


def test_a_profile_without_the_descriptive_gpu_block_still_loads(tmp_path, seed):
    del seed["gpu"]  # profiles written by other builds may lack it; no rule reads it
    path = write(tmp_path, seed)
    assert load_profile(path).data["gpu"] is None
    res = run_ft("profile", "show", str(path), env=ft_env(COLUMNS="80"))
    assert res.returncode == 0, res.stderr
    assert "GPU: none" in res.stdout


@pytest.mark.timeout(120)
def test_notes_sit_under_the_table_at_80_columns():
    res = run_ft("profile", "show", str(SEED_PROFILE), env=ft_env(COLUMNS="80"))
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == 5  # one line a format: nothing wraps
    assert "[1] fp8_block: CPU MoE has no fp8_block weight path; hybrid unavailable" in res.stdout
    assert "│ [1]  │" in next(r for r in rows if "fp8_block" in r)


def test_load_errors(tmp_path):
    with pytest.raises(FtError, match="no bandwidth profile at .*benchbw.json"):
        load_profile()
    with pytest.raises(FtError, match="malformed JSON at line 1"):
        load_profile(write(tmp_path, '{"version": 4,'))
    with pytest.raises(FtError, match="should be a JSON object, got array"):
        load_profile(write(tmp_path, "[]"))


@pytest.mark.timeout(120)
def test_cli_show_seed_profile():
    res = run_ft("profile", "show", str(SEED_PROFILE), env=ft_env(COLUMNS="200"))
    assert res.returncode == 0, res.stderr
    assert "27.8%" in res.stdout and "hybrid unavailable" in res.stdout
    res = run_ft("profile", "show", str(SEED_PROFILE), "--json")
    decisions = json.loads(res.stdout)["decisions"]
    assert decisions["mxfp4_triton"]["recommended"] == "offload"
    assert round(decisions["nvfp4"]["fetch_fraction"], 3) == 0.278


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "content,message",
    [
        ('{"version": 4', "malformed JSON"),
        ('{"version": 7}', "field 'version' is 7"),
        ('{"version": 4, "written": "x"}', "missing field 'cpu'"),
    ],
)
def test_cli_bad_profiles_one_line_exit_1(tmp_path, content, message):
    res = run_ft("profile", "show", str(write(tmp_path, content)))
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


@pytest.mark.timeout(120)
def test_cli_missing_default_profile():
    res = run_ft("profile", "show")
    assert res.returncode == 1 and "benchbw.json" in res.stderr and "Traceback" not in res.stderr


def test_fetch_log_line_in_the_seed_words():
    line = fetch_log_line(decide(load_profile(SEED_PROFILE), "nvfp4"))
    assert line == (
        "--moe-hybrid-max-fetch auto: fetching 27.8% of each decode step's expert misses over"
        " PCIe (benched PCIe/CPU bandwidth ratio), the rest on the CPU"
    )
    with pytest.raises(FtError, match="no overlapped numbers for fp8_block"):
        fetch_log_line(decide(load_profile(SEED_PROFILE), "fp8_block"))


@pytest.mark.parametrize(
    "path", sorted((REPO_ROOT / "profiles").glob("*.json")), ids=lambda p: p.name
)
def test_reference_profiles_load_and_agree_with_the_rules(path):
    profile = load_profile(path)
    assert profile.data.get("source"), "a reference profile says where its numbers come from"
    assert profile.data["dtypes"] == {f: decide(profile, f).recommended for f in profile.formats}
