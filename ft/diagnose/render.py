"""report.json -> report.md: findings first, then threads, hottest frames, GPU, environment."""

from __future__ import annotations

import json
import re

from ft.report import code_block, details, md_table

TOP_THREADS = 15  # in the visible table; the rest go in <details>
FRAMES_FOR = 4  # busy threads whose stacks are shown in full
BUSY_PCT = 5.0  # % of a core (running or waiting for one) that makes a thread worth reading
_DETAILS = re.compile(r"<details>.*?</details>", re.DOTALL)


def details_spans(md: str) -> list[tuple[int, int]]:
    return [m.span() for m in _DETAILS.finditer(md)]


def markdown(report: dict, log_tail: str = "") -> str:
    parts = [_header(report), _throughput(report), _sampling(report), _findings(report)]
    parts += [_threads(report)]
    parts += [_frames(report), _gpu(report)]
    parts += [_startup(report), _environment(report), _events(report)]
    if log_tail:
        parts.append(details("Target output (last lines)", code_block(log_tail)))
    parts.append(_files(report))
    return "\n\n".join(p for p in parts if p) + "\n"


def _header(r: dict) -> str:
    target = r["target"].get("command") or " ".join(r["target"].get("argv", []))
    run = r["run"]
    stacks = (
        f"stacks from {run['stack_source']} ({run['stack_samples']} samples)"
        if run["stack_source"]
        else "no stacks"
    )
    exit_text = f", exit code {run['exit_code']}" if run["exit_code"] is not None else ""
    failed = f"\n\n**The target failed**: {run['failure']}" if run.get("failure") else ""
    attached = f" (attached to pid {r['target']['pid']})" if r["target"].get("pid") else ""
    return (
        f"# ft diagnose\n\n`{target}`{attached}: {run['duration_s']:.1f} s sampled"
        f"{' (the workload window)' if run.get('window') == 'workload' else ''}, stopped by "
        f"{run['stopped_by']}{exit_text}; {run['thread_samples']} thread samples, {stacks}."
        f"{failed}"
    )


def _throughput(r: dict) -> str:
    tp = r.get("throughput")
    if not tp:
        return ""
    if tp.get("error"):
        return f"Workload failed: {tp['error']}"
    figures = [("end-to-end decode tok/s", tp.get("e2e_decode_tok_s")),
               ("engine decode tok/s", tp.get("engine_decode_tok_s")),
               ("TTFT s (median)", tp.get("ttft_s")),
               ("throughput tok/s", tp.get("throughput_tok_s"))]  # fmt: skip
    return md_table(("workload", "value"), [(k, _num(v)) for k, v in figures])


def _sampling(r: dict) -> str:
    """How the probes sampled and what that was measured to cost: how far to trust a tok/s."""
    s = r.get("sampling")
    if not s:
        return ""
    rows = [
        ("threads", f"{s['threads']['source']} every {s['threads']['interval_s']:g} s",
         s["threads"]["samples"]),
        ("GPU", f"{s['gpu']['source']} every {s['gpu']['interval_s']:g} s", s["gpu"]["samples"]),
    ]  # fmt: skip
    agent, spy = s["stacks"].get("agent"), s["stacks"].get("py-spy")
    if agent:
        rows.append(("stacks: agent", f"every {agent['interval_s']:g} s", agent["samples"]))
    if spy:
        paused = f", at most {spy['max_paused']:.0%} of the run paused" if spy["max_paused"] else ""
        how = f"{spy['mode']}, every {spy['every_s']:g} s or sparser{paused}"
        rows.append(("stacks: py-spy", how, spy["samples"]))
    table = md_table(("probe", "how", "samples"), rows)
    return f"## Sampling\n\n{table}\n\nExpected cost of these probes: {s['expected_cost_note']}."


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _findings(r: dict) -> str:
    if not r["findings"] and r["context"].get("workload") is False and r["run"].get("failure"):
        return "## Findings\n\nNo diagnosis: the server failed before it was ready to serve."
    if not r["findings"]:
        return "## Findings\n\nNo findings: no rule matched the samples."
    out = ["## Findings"]
    for f in r["findings"]:
        evidence = ", ".join(f"{k}={_short(v)}" for k, v in f["evidence"].items() if v is not None)
        out.append(
            f"### {f['severity']}: `{f['id']}`\n\n{f['title']}\n\n"
            f"- **Evidence**: {evidence}\n- **Next step**: {f['next_step']}"
        )
    return "\n\n".join(out)


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return f"`{text}`" if len(text) < 200 else f"`{text[:197]}...`"


_COLUMNS = ("tid", "name", "role", "CPU % (mean / max)", "state R", "states", "CPU s",
            "run delay %",            "wchan", "allowed CPUs", "ctxt vol / invol")  # fmt: skip


def _thread_row(t: dict) -> list:
    states = " ".join(f"{k}:{v}" for k, v in sorted(t["states"].items()))
    return [t["tid"], t["name"], t["role"], f"{t['cpu_pct']:.1f} / {t['cpu_pct_max']:.1f}",
            f"{t['r_frac']:.0%}", states, t["cpu_s"], t["delay_pct"], t["wchan"],
            t["cpus_allowed"], f"{t['ctxt_voluntary']} / {t['ctxt_nonvoluntary']}"]  # fmt: skip


def _threads(r: dict) -> str:
    threads = r["threads"]
    if not threads:
        return "## Threads\n\nNo thread samples (the target ended before the first sample)."
    out = f"## Threads ({len(threads)}, busiest first)\n\n"
    out += md_table(_COLUMNS, [_thread_row(t) for t in threads[:TOP_THREADS]])
    if len(threads) > TOP_THREADS:
        rest = md_table(_COLUMNS, [_thread_row(t) for t in threads[TOP_THREADS:]])
        out += "\n\n" + details(f"{len(threads) - TOP_THREADS} more threads", rest)
    return out


def _frames(r: dict) -> str:
    sampled = [t for t in r["threads"] if t["stack_samples"]]
    if not sampled:
        return "## Hottest frames\n\nNo stack samples (not a Python target, or none were taken)."
    busy = [t for t in sampled if t["cpu_pct"] + t["delay_pct"] >= BUSY_PCT][:FRAMES_FOR]
    out = ["## Hottest frames"]
    if not busy:
        out.append(f"No thread used more than {BUSY_PCT:.0f}% of a core.")
    for t in busy:
        share = t["top_stack_count"] / t["stack_samples"]
        stack = "\n".join(t["top_stack"][::-1])
        block = (
            f"### {t['name']} (tid {t['tid']}, {t['role']}, {t['cpu_pct']:.0f}% CPU)\n\n"
            f"Most common stack, innermost first ({share:.0%} of {t['stack_samples']} samples):\n\n"
            + code_block(stack)
        )
        funcs = md_table(("leaf function", "samples"), t["top_functions"])
        block += "\n\n" + details("Leaf functions by samples", funcs)
        if t["native_stack"]:
            native = code_block("\n".join(t["native_stack"][::-1]))
            block += "\n\n" + details("Native stack (py-spy --native, last dump)", native)
        out.append(block)
    every = "\n\n".join(
        f"{t['name']} (tid {t['tid']}, {t['role']}, {t['cpu_pct']:.0f}% CPU):\n\n"
        + code_block("\n".join(t["top_stack"][::-1]))
        for t in sampled
    )
    out.append(details(f"Most common stack of every thread ({len(sampled)})", every))
    return "\n\n".join(out)


def _startup(r: dict) -> str:
    if not r.get("startup"):
        return ""
    return "## Engine startup\n\n" + code_block("\n".join(r["startup"]))


def _gpu(r: dict) -> str:
    g = r["gpu"]
    if not g["available"]:
        return f"## GPU\n\nUnavailable: {g['reason']}."
    rows = [
        ("device", g["name"]),
        ("utilisation % (mean / max)", f"{g['util_pct']} / {g['util_pct_max']}"),
        ("memory used / total MiB", f"{g['mem_used_mib']} / {g['mem_total_mib']}"),
        ("SM clock MHz (mean)", g["sm_clock_mhz"]),
        ("PCIe link", f"gen{g['pcie_gen']} x{g['pcie_width']} ({g['link_gbs']} GB/s one way)"),
        ("PCIe RX / TX GB/s (mean)", f"{g['rx_gbs']} / {g['tx_gbs']}"),
    ]
    return "## GPU\n\n" + md_table(("", ""), rows)


def _environment(r: dict) -> str:
    env = dict(r["env"])
    variables = env.pop("env", {})
    rows = [(k, "-" if v is None else _short(v).strip("`")) for k, v in env.items()]
    body = md_table(("fact", "value"), rows)
    if variables:
        body += "\n\n" + md_table(("variable", "value"), sorted(variables.items()))
    summary = ", ".join(
        str(env.get(k)) for k in ("python", "torch", "cpu_model") if env.get(k) is not None
    )
    return "## Environment\n\n" + details(f"ft {env.get('ft', '?')}, {summary}", body)


def _events(r: dict) -> str:
    """What went wrong in the probes themselves (py-spy failures, a probe's error)."""
    rows = [(e.get("event"), e.get("pid", ""), e.get("detail", "")) for e in r["events"]]
    if not rows:
        return ""
    return details(f"Probe events ({len(rows)})", md_table(("event", "pid", "detail"), rows))


def _files(r: dict) -> str:
    return "Files: " + ", ".join(f"`{name}`" for name in r["files"].values())
