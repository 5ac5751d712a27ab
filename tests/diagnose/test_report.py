"""report.md stays under GitHub's comment limit and puts the findings first; report.json is v1."""

import json
from types import SimpleNamespace

from ft.diagnose.compare import write_comparison
from ft.diagnose.report import PLAIN_NEXT_STEPS, collapsed_stacks, fit_limit, write_report
from ft.probes.sampler import Stream
from ft.report import GITHUB_COMMENT_LIMIT, details
from tests.diagnose.synthetic import T, engine_main, pool, stream


def write(tmp_path, records) -> dict:
    s = Stream(tmp_path / "samples.jsonl")
    for rec in records:
        s.write(rec)
    s.close()
    outcome = SimpleNamespace(
        stream=tmp_path / "samples.jsonl", stopped_by="duration", exit_code=None
    )
    return write_report(tmp_path, outcome)


def test_report_of_a_huge_target_fits_one_github_comment(tmp_path):
    deep = [f"frame_{i} (module_{i}.py:{i})" for i in range(60)]
    threads = [engine_main(), *pool(40)]
    threads += [T(1000 + k, name=f"worker-{k}", cpu=1, frames=deep) for k in range(400)]
    report = write(tmp_path, stream(threads, ticks=3))
    md = (tmp_path / "report.md").read_text()
    assert len(md) <= GITHUB_COMMENT_LIMIT
    assert md.index("hot-thread") < md.index("## Threads")
    assert "inline_experts" in md  # the answer survives the cut
    assert report["schema"] == 1 and len(report["threads"]) == 441
    assert json.loads((tmp_path / "report.json").read_text())["findings"][0]["id"] == ("hot-thread")


def test_fit_limit_drops_the_largest_details_first():
    small, big = details("small", "s" * 100), details("big", "b" * 5000)
    md = fit_limit(f"# head\n\n{small}\n\n{big}\n", limit=2000)
    assert len(md) <= 2000 and "s" * 100 in md and "b" * 5000 not in md
    assert len(fit_limit("x" * 5000, limit=1000)) <= 1000


def test_collapsed_stacks_count_identical_stacks():
    recs = stream([engine_main()], ticks=4)
    text = collapsed_stacks([r for r in recs if r["kind"] == "stacks"], "agent")
    (line,) = text.splitlines()
    assert line.startswith("process 100;MainThread (100);<module> (serve.py:1);step")
    assert line.endswith("inline_experts (moe.py:42) 4")


def test_next_steps_name_engine_commands_only_for_the_engine(tmp_path):
    threads = [engine_main(), *pool(2)]
    (tmp_path / "plain").mkdir()
    (tmp_path / "engine").mkdir()
    plain = write(tmp_path / "plain", stream(threads, ticks=4))
    engine = write(tmp_path / "engine", stream(threads, ticks=4, context={"strategy": "hybrid"}))
    hot = {r: rep["findings"][0] for r, rep in (("plain", plain), ("engine", engine))}
    assert hot["plain"]["id"] == hot["engine"]["id"] == "hot-thread"
    assert hot["plain"]["next_step"] == PLAIN_NEXT_STEPS["hot-thread"]
    assert "ft diagnose --strategy" not in (tmp_path / "plain" / "report.md").read_text()
    assert "ft bisect" in hot["engine"]["next_step"]


def test_the_side_by_side_names_the_busiest_thread_s_state_not_a_wchan_of_0(tmp_path):
    runs = {}
    for strategy, main in (("hybrid", engine_main()), ("offload", engine_main(30, "S"))):
        (tmp_path / strategy).mkdir()
        records = stream([main, *pool(1)], ticks=4, context={"strategy": strategy})
        runs[strategy] = write(tmp_path / strategy, records)
    md = write_comparison(tmp_path, runs)
    hybrid, offload = (ln for ln in md.splitlines() if ln.startswith(("| hybrid", "| offload")))
    assert "| MainThread 99% CPU, running |" in hybrid and " 0 |" not in hybrid
    assert "| MainThread 30% CPU, sleeping in futex_do_wait |" in offload
    assert "(1 thread)" in hybrid and "threads)" not in hybrid


def _sampled(tmp_path, source: str, attached: bool = False, gpu: dict | None = None) -> dict:
    config = {"interval": 0.5, "agent_interval": 0.1, "stack_source": source, "duration": 10}
    records = stream([engine_main(), *pool(2)], ticks=4, gpu=gpu, config=config)
    if source == "py-spy":  # py-spy alone: its dumps are the only stacks
        for rec in records:
            if rec["kind"] == "stacks":
                rec["source"] = "py-spy"
    if source == "auto":
        records.append({"kind": "stacks", "source": "py-spy", "t": 1.0, "pid": 100, "threads": []})
    if attached:
        records.append({"kind": "end", "t": 4.0, "context": {"attached": True}})
    folder = tmp_path / f"{source}-{attached}"
    folder.mkdir()
    return write(folder, records)


def test_every_report_says_how_it_sampled_for_each_stack_source(tmp_path):
    agent, spy, auto = (_sampled(tmp_path, s)["sampling"] for s in ("agent", "py-spy", "auto"))
    for block in (agent, spy, auto):
        assert block["threads"] == {"source": "/proc", "interval_s": 0.5, "samples": 4}
        assert block["gpu"]["samples"] == 4
    assert agent["stacks"] == {"agent": {"interval_s": 0.1, "samples": 4}}
    assert set(spy["stacks"]) == {"py-spy"} and spy["stacks"]["py-spy"]["samples"] == 4
    assert spy["stacks"]["py-spy"]["every_s"] == 0.5  # alone, it is the stack source
    assert auto["stacks"]["agent"]["samples"] == 4 and auto["stacks"]["py-spy"]["samples"] == 1
    beside = auto["stacks"]["py-spy"]
    assert beside["every_s"] >= 5 and beside["max_paused"] <= 0.01  # only native frames to add
    assert beside["mode"] == "--native, pauses the target"
    md = (tmp_path / "auto-False" / "report.md").read_text()
    assert md.index("## Sampling") < md.index("## Findings")
    assert "| stacks: py-spy | --native, pauses the target, every 5 s or sparser" in md


def test_an_attached_target_is_read_without_pausing(tmp_path):
    block = _sampled(tmp_path, "auto", attached=True)["sampling"]
    assert block["stacks"]["py-spy"]["mode"] == "--nonblocking"
    assert block["stacks"]["py-spy"]["max_paused"] == 0.0
    assert block["expected_cost"] is None and "attached" in block["expected_cost_note"]


def test_the_expected_cost_is_the_measured_row_of_this_box_and_configuration(tmp_path, monkeypatch):
    from ft.probes import cost

    row = cost.MeasuredCost("gpu", "auto", 0.5, 0.1, 1.2, 0.4, 2.0, "2026-12-04", "ft bench")
    monkeypatch.setattr(cost, "MEASURED", (row,))
    on_gpu = _sampled(tmp_path, "auto", gpu={"util_pct": 90})["sampling"]
    assert on_gpu["expected_cost"]["overhead_pct"] == 1.2
    assert "+1.2%" in on_gpu["expected_cost_note"] and "gpu box" in on_gpu["expected_cost_note"]
    on_cpu = _sampled(tmp_path, "agent")["sampling"]
    assert on_cpu["expected_cost"] is None and "not measured" in on_cpu["expected_cost_note"]
    md = (tmp_path / "auto-False" / "report.md").read_text()
    assert "Expected cost of these probes: measured +1.2%" in md


def test_the_cost_table_covers_diagnose_defaults_for_every_stack_source():
    from pathlib import Path

    from ft.diagnose.runner import DiagnoseConfig
    from ft.probes.cost import expected_cost
    from ft.probes.stacks import STACK_SOURCES

    d = DiagnoseConfig(out_dir=Path("."))
    for source in STACK_SOURCES:
        row = expected_cost("cpu", source, d.interval, d.agent_interval)
        assert row is not None and row.low_pct <= row.overhead_pct <= row.high_pct, source
    # the GPU box has rows for the default source and the agent (py-spy alone not measured there)
    for source in ("auto", "agent"):
        row = expected_cost("gpu", source, d.interval, d.agent_interval)
        assert row is not None and row.low_pct <= row.overhead_pct <= row.high_pct, source
    assert expected_cost("gpu", "py-spy", d.interval, d.agent_interval) is None


def test_the_stacks_file_keeps_the_whole_run_when_the_workload_window_has_no_stack(tmp_path):
    records = stream([engine_main()], ticks=4)
    last = max(r["t"] for r in records if "t" in r)
    records.append({"kind": "phase", "t": last + 1.0, "phase": "workload"})  # after every stack
    report = write(tmp_path, records)
    assert report["run"]["stack_source"] is None  # nothing sampled inside the window
    text = (tmp_path / "stacks.collapsed").read_text()
    assert "inline_experts (moe.py:42) 4" in text
