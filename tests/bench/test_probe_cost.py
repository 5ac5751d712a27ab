"""`ft bench probes`' logic on a fake target whose speed the test sets: alternation, statistics."""

import random
from contextlib import contextmanager

import pytest

from ft.bench.probe_cost import (
    BASELINE,
    baseline_figures,
    overheads,
    probe_settings,
    run_trials,
    schedule,
)

SETTINGS = probe_settings(["agent", "py-spy"], interval=0.5, agent_interval=0.1, fast=5)


class FakeServer:
    """Decodes at 100 tok/s times (1 - the running probe's cost), with seeded noise and a slow
    drift over the run (a warming box): a fair benchmark pairs rounds and still reads the cost."""

    def __init__(self, costs: dict[str, float], noise: float = 0.01, seed: int = 1):
        self.costs = costs
        self.noise = noise
        self.rng = random.Random(seed)
        self.running: str | None = None
        self.runs = 0

    @contextmanager
    def probes(self, setting):
        assert self.running is None
        self.running = setting.stack_source and setting.name
        try:
            yield {"threads": 3} if setting.stack_source else {}
        finally:
            self.running = None

    def measure(self) -> dict:
        self.runs += 1
        speed = 100 * (1 - 0.001 * self.runs) * (1 + self.rng.gauss(0, self.noise))
        speed *= 1 - self.costs.get(self.running, 0.0)
        return {"e2e_decode_tok_s": speed, "engine_decode_tok_s": None}


def test_settings_are_the_baseline_then_each_source_at_default_and_fast_intervals():
    names = [(s.name, s.stack_source, s.interval, s.agent_interval) for s in SETTINGS]
    assert names == [
        (BASELINE, None, 0.5, 0.1),
        ("agent", "agent", 0.5, 0.1),
        ("agent fast", "agent", 0.1, 0.02),
        ("py-spy", "py-spy", 0.5, 0.1),
        ("py-spy fast", "py-spy", 0.1, 0.02),
    ]
    assert [s.name for s in probe_settings(["auto"], 0.5, 0.1, None)] == [BASELINE, "auto"]


def test_runs_alternate_with_the_baseline_and_rounds_rotate_the_probed_settings():
    order = [(r, s.name) for r, s in schedule(SETTINGS, repeats=3)]
    names = [name for _, name in order]
    assert names[::2] == [BASELINE] * 13  # every probed run sits between two without probes
    probed = [[name for r, name in order[1::2] if r == k] for k in range(3)]
    assert all(sorted(p) == sorted(s.name for s in SETTINGS[1:]) for p in probed)
    assert probed[1] == probed[0][1:] + probed[0][:1]  # no setting always runs first
    assert len({p[0] for p in probed}) == 3


def test_a_probe_that_costs_ten_percent_reads_ten_percent_and_a_free_one_reads_zero():
    fake = FakeServer({"py-spy": 0.10, "py-spy fast": 0.20})
    trials = run_trials(SETTINGS, 6, fake.measure, fake.probes)
    assert fake.runs == 6 * 2 * (len(SETTINGS) - 1) + 1
    by_name = {o.setting: o for o in overheads(trials, "e2e_decode_tok_s")}
    spy, spy_fast, agent = by_name["py-spy"], by_name["py-spy fast"], by_name["agent"]
    assert spy.overhead == pytest.approx(0.10, abs=0.015)
    assert spy.low <= 0.10 <= spy.high
    assert spy_fast.overhead == pytest.approx(0.20, abs=0.015)
    assert agent.overhead == pytest.approx(0.0, abs=0.015)
    assert agent.low <= 0.0 <= agent.high
    assert agent.high < spy.low  # the interval tells a free probe from a 10% one
    assert spy.rounds == 6 and spy.median == pytest.approx(90 * (1 - 0.001 * 25), rel=0.03)


def test_samples_taken_are_kept_per_trial_and_missing_figures_are_left_out():
    fake = FakeServer({})
    trials = run_trials(SETTINGS, 2, fake.measure, fake.probes)
    assert {t.setting: t.samples for t in trials if t.round == 0}["agent"] == {"threads": 3}
    engine = overheads(trials, "engine_decode_tok_s")
    assert all(o.overhead is None and o.median is None and o.rounds == 0 for o in engine)
    assert baseline_figures(trials, "engine_decode_tok_s") == {"median": None, "spread": None}
    two = overheads(trials, "e2e_decode_tok_s")[0]
    assert two.rounds == 2 and two.low is None  # too few rounds for an interval


def test_live_probes_sample_a_process_through_its_on_demand_agent(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from ft.bench.probe_cost import ProbeSetting
    from ft.bench.probe_live import live_probes
    from ft.probes.stacks import AGENT_DIR

    env = dict(os.environ) | {"FT_AGENT_ATTACH": str(tmp_path), "PYTHONPATH": str(AGENT_DIR)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        with live_probes(proc.pid, tmp_path, ProbeSetting("agent", "agent", 0.1, 0.05)) as got:
            answered_before_the_trial = bool(list(tmp_path.glob("*/stacks-*.jsonl")))
            time.sleep(0.5)
        with live_probes(proc.pid, tmp_path, ProbeSetting("none", None)) as none:
            pass
    finally:
        proc.kill()
        proc.wait()
    assert answered_before_the_trial  # else a trial would measure a second without the agent
    assert got["threads"] >= 3 and got["stacks:agent"] >= 1 and "stacks:py-spy" not in got
    assert none == {}
    assert not list(tmp_path.glob("request-*.json"))  # the agent was told to stop


def test_bench_probes_refuses_an_unknown_stack_source():
    from typer.testing import CliRunner

    from ft.cli.app import app

    result = CliRunner().invoke(app, ["bench", "probes", "--sources", "agent,gdb"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: --sources takes auto, agent, py-spy")


def test_a_cost_metric_reads_positive_when_it_rises_and_probe_cpu_is_a_share_of_the_wall():
    from ft.bench.probe_cost import Trial, probe_cpu_share

    trials = [
        Trial(0, BASELINE, {"server_cpu_ms_per_token": 2.0}, {}, 1.0),
        Trial(0, "agent", {"server_cpu_ms_per_token": 2.1}, {"probe_cpu_ms": 10.0}, 2.0),
        Trial(0, BASELINE, {"server_cpu_ms_per_token": 2.0}, {}, 1.0),
        Trial(1, "agent", {"server_cpu_ms_per_token": 2.1}, {"probe_cpu_ms": 30.0}, 2.0),
        Trial(1, BASELINE, {"server_cpu_ms_per_token": 2.0}, {}, 1.0),
    ]
    (cpu,) = overheads(trials, "server_cpu_ms_per_token")
    assert cpu.overhead == pytest.approx(0.05)
    assert probe_cpu_share(trials) == {"agent": pytest.approx(0.01)}  # 40 ms over 4 s
