"""`ft bisect --ray local` in engine mode on the GPU box: `ft demo`'s scratch history (the
planted hybrid regression), one worker holding the one GPU, against `--jobs 1` without Ray."""

from __future__ import annotations

import dataclasses
import time

import pytest

from ft.demo.config import DemoConfig
from ft.demo.history import build_history
from ft.demo.prepare import demo_model, isolated_env, measure_profile
from ft.demo.stages import bisect_options

pytest.importorskip("ray")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_ray_local_names_the_demos_planted_commit_on_the_gpu(tmp_path):
    from ft.bisect.driver import bisect

    config = DemoConfig(out=tmp_path / "demo", device="cuda", prompts=1, max_tokens=16,
                        repeats=2)  # fmt: skip
    config.out.mkdir(parents=True)
    model = demo_model(print)
    profile = measure_profile(config, print)
    seconds = {}
    with isolated_env(config.out, profile.path):  # the raylets started below inherit it
        history = build_history(config.out / "scratch")
        base = bisect_options(config, history, model)
        for name, ray in (("jobs-1", None), ("ray-local", "local")):
            opts = dataclasses.replace(base, out=str(config.out / name), ray=ray)
            start = time.monotonic()
            rep = bisect(opts, lambda msg, name=name: print(f"{name}: {msg}"))
            seconds[name] = round(time.monotonic() - start, 1)
            assert rep["outcome"] == "found", (name, rep["message"])
            assert rep["culprit"]["sha"] == history.planted_sha, name
    assert rep["cluster"]["gpus"] == 1 and rep["cluster"]["per_job"] == "1 GPU"
    node = rep["nodes"][0]
    assert len(rep["nodes"]) == 1 and node["gpu"]  # its name, from NVML
    samples = [s for r in rep["commits"] for s in r["samples"]]
    assert {s["node"] for s in samples} == {node["key"]} and all(s["gpu"] for s in samples)
    print(f"\nseconds: {seconds}")  # for the note: --ray local beside --jobs 1 without Ray
