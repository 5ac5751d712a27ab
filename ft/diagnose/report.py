"""The report directory: report.json (schema 1), report.md, stacks.collapsed, timeline.png.

report.json, schema 1 (a key is only ever added; a change of meaning bumps "schema"):
    schema, kind="ft-diagnose", created (UTC), target {kind, argv, command|strategy, ...},
    config {duration, interval, stack_source, ...}, context {strategy, expects_cpu_pool, ...},
    run {duration_s, stopped_by, exit_code, failure, thread_samples, stack_source, stack_samples},
    sampling {threads, gpu, stacks {agent, py-spy}, expected_cost | null, expected_cost_note},
    findings [{id, severity, title, evidence, next_step, threads}], threads [ThreadSummary],
    gpu GpuSummary, throughput (the workload's figures) | null, events, startup [lines],
    env (as `ft env --json`), files {role: file name}.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from ft.diagnose import render
from ft.diagnose.findings import Finding, findings
from ft.diagnose.startup import startup_lines
from ft.diagnose.summary import by_kind, primary_stacks, summarize
from ft.log import get_logger
from ft.probes.cost import sampling
from ft.probes.sampler import read_stream
from ft.probes.stacks import expand_stacks
from ft.report import GITHUB_COMMENT_LIMIT, write_json_atomic, write_text_atomic

SCHEMA = 1
FILES = {
    "report_md": "report.md",
    "report_json": "report.json",
    "stacks": "stacks.collapsed",
    "timeline": "timeline.png",
    "samples": "samples.jsonl",
    "target_log": "target.log",
}


def write_report(out_dir: Path, outcome) -> dict:
    """Every report file from the stream on disk; returns report.json's content."""
    records = expand_stacks(read_stream(outcome.stream))
    kinds = by_kind(records)
    start = (kinds["start"] or [{}])[0]
    end = (kinds["end"] or [{}])[-1]
    context = end.get("context") or start.get("context") or {}
    summary = summarize(records, context)
    rules = (
        [_for_target(f, context) for f in findings(summary)]
        if _diagnosable(outcome, context)
        else []
    )
    report = {
        "schema": SCHEMA,
        "kind": "ft-diagnose",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": start.get("target", {}),
        "config": start.get("config", {}),
        "context": context,
        "run": {
            "duration_s": summary.duration_s,
            "window": summary.window,
            "stopped_by": outcome.stopped_by,
            "exit_code": outcome.exit_code,
            "failure": _failure(outcome),
            "thread_samples": len(kinds["threads"]),
            "stack_source": summary.stack_source,
            "stack_samples": summary.stack_samples,
        },
        "sampling": _sampling(start.get("config", {}), context, kinds),
        "findings": [f.to_json() for f in rules],
        "threads": [asdict(t) | {"hottest_frames": t.hottest_frames} for t in summary.threads],
        "gpu": asdict(summary.gpu) | {"link_gbs": summary.gpu.link_gbs},
        "throughput": next((r for r in kinds["throughput"] if r.get("final")), None),
        "events": summary.events,
        "startup": startup_lines(_log_tail(out_dir / FILES["target_log"], None)),
        "env": (kinds["env"] or [{}])[0].get("env", {}),
        "files": FILES,
    }
    # the whole run's stacks, load included: a short workload window may hold no stack sample
    # (then the summary has no source), and the file is where a reader looks for every thread
    whole_run, source = primary_stacks(kinds["stacks"])
    write_text_atomic(out_dir / FILES["stacks"], collapsed_stacks(whole_run, source))
    _timeline(
        out_dir / FILES["timeline"], kinds, {t.tid: (t.name, t.role) for t in summary.threads}
    )
    write_json_atomic(out_dir / FILES["report_json"], report)
    md = fit_limit(render.markdown(report, _log_tail(out_dir / FILES["target_log"])))
    write_text_atomic(out_dir / FILES["report_md"], md)
    return report


def _sampling(config: dict, context: dict, kinds: dict[str, list[dict]]) -> dict:
    counts = {"threads": len(kinds["threads"]), "gpu": len(kinds["gpu"])}
    for source in ("agent", "py-spy"):
        counts[f"stacks:{source}"] = sum(r.get("source") == source for r in kinds["stacks"])
    gpu = any(r.get("available") for r in kinds["gpu"])
    return sampling(config, bool(context.get("attached")), counts, gpu)


def _diagnosable(outcome, context: dict) -> bool:
    """A server that failed before it was ready only imported and started up: its samples
    are no diagnosis of anything (its hot frames would be Python's import machinery)."""
    return not (_failure(outcome) and context.get("workload") is False)


def _failure(outcome) -> str | None:
    return getattr(outcome, "failure", None)  # outcomes built elsewhere may not say


# Next steps for a program that is not the engine (`--cmd` of anything but `ft serve`), where
# the rules' own advice names engine flags and commands that program does not have.
PLAIN_NEXT_STEPS = {
    "hot-thread": (
        "Read the hottest frames: they are what this thread spends its core on while the GPU "
        "and the other threads wait."
    ),
    "fetch-bound": (
        "The GPU waits on host-to-device copies: keep the data on the device, copy less, or "
        "overlap the copies with compute."
    ),
}


def _for_target(finding: Finding, context: dict) -> Finding:
    """The finding, with a next step the target can act on (the engine names its strategy)."""
    plain = PLAIN_NEXT_STEPS.get(finding.id)
    if plain is None or context.get("strategy"):
        return finding
    return replace(finding, next_step=plain)


def collapsed_stacks(stacks: list[dict], source: str | None) -> str:
    """`process;thread;frame;...;leaf count` lines: flamegraph.pl / speedscope / inferno input."""
    counts: Counter = Counter()
    for rec in stacks:
        if rec.get("source") != source:
            continue
        for th in rec["threads"]:
            head = [f"process {rec['pid']}", f"{th.get('name') or 'thread'} ({th.get('tid')})"]
            counts[";".join(f.replace(";", ",") for f in head + th["frames"])] += 1
    return "".join(f"{stack} {n}\n" for stack, n in counts.most_common())


def fit_limit(md: str, limit: int = GITHUB_COMMENT_LIMIT) -> str:
    """Drop the largest <details> blocks until it fits one GitHub comment; cut as a last resort."""
    note = "\n\n_(omitted to fit GitHub's comment limit; see report.json)_\n\n"
    while len(md) > limit:
        blocks = render.details_spans(md)
        if not blocks:
            break
        lo, hi = max(blocks, key=lambda span: span[1] - span[0])
        if hi - lo <= len(note):
            break
        md = md[:lo] + note + md[hi:]
    if len(md) > limit:
        cut = "\n\n_(truncated; see report.json)_\n"
        md = md[: limit - len(cut)] + cut
    return md


def _log_tail(path: Path, lines: int | None = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-(lines or 0) :])
    except OSError:
        return ""


def _timeline(path: Path, kinds: dict[str, list[dict]], roles: dict) -> None:
    try:
        from ft.diagnose.timeline import plot

        plot(path, kinds, roles)
    except Exception as exc:  # a plot must never cost the report
        get_logger("ft.diagnose").warning("timeline plot failed: %s", exc)
