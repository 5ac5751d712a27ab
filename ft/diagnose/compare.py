"""`ft diagnose --strategy A --vs B`: the two runs side by side (each keeps its own report)."""

from __future__ import annotations

from pathlib import Path

from ft.report import md_table, plural, write_json_atomic, write_text_atomic

SCHEMA = 1


def _row(strategy: str, r: dict) -> list:
    tp = r.get("throughput") or {}
    top = r["findings"][0]["id"] if r["findings"] else "-"
    gpu = r["gpu"]
    pool = [t["cpu_pct"] for t in r["threads"] if t["role"] == "cpu-moe pool"]
    main = max(r["threads"], key=lambda t: t["cpu_pct"], default=None)
    return [
        strategy,
        _fmt(tp.get("e2e_decode_tok_s")),
        _fmt(tp.get("engine_decode_tok_s")),
        _fmt(gpu.get("util_pct")) if gpu["available"] else "n/a",
        f"{sum(pool):.0f}% ({plural(len(pool), 'thread')})" if pool else "no pool",
        _busiest(main),
        top,
        f"[report]({strategy}/report.md)",
    ]


def _busiest(thread: dict | None) -> str:
    """`ft-engine 93% CPU, running` or `MainThread 3% CPU, sleeping in futex_wait_queue`: its
    most common state, and its wait channel where it waits (a running thread's wchan is 0)."""
    if thread is None:
        return "-"
    states = thread["states"]
    state = max(states, key=states.get) if states else "?"
    words = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait"}.get(state, state)
    wchan = thread["wchan"]
    where = f" in {wchan}" if state != "R" and wchan not in ("0", "", None) else ""
    return f"{thread['name']} {thread['cpu_pct']:.0f}% CPU, {words}{where}"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def write_comparison(out: Path, runs: dict[str, dict]) -> str:
    headers = ("strategy", "e2e decode tok/s", "engine tok/s", "GPU util %", "pool CPU",
               "busiest thread", "top finding", "")  # fmt: skip
    table = md_table(headers, [_row(s, r) for s, r in runs.items()])
    findings = "\n".join(
        f"- **{s}**: `{f['id']}`: {f['title']}" for s, r in runs.items() for f in r["findings"][:3]
    )
    md = f"# ft diagnose: {' vs '.join(runs)}\n\n{table}\n\n## Findings\n\n{findings or 'None.'}\n"
    write_text_atomic(out / "report.md", md)
    index = {"schema": SCHEMA, "kind": "ft-diagnose-compare"}
    write_json_atomic(out / "report.json", index | {"runs": {s: f"{s}/report.json" for s in runs}})
    return md
