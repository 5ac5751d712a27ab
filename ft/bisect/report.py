"""The bisect report: report.json (versioned, raw samples), report.md (an issue comment),
plot.png (the figure along the range)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ft.bisect.gitrepo import UserRepo
from ft.bisect.search import BisectResult
from ft.bisect.stats import Effect, median, spread
from ft.bisect.store import SampleStore
from ft.report import code_block, details, md_table, write_json_atomic, write_text_atomic

REPORT_VERSION = 1
COLORS = {"good": "tab:green", "bad": "tab:red", "unknown": "tab:orange", "skip": "tab:gray"}


def build(
    result: BisectResult, repo: UserRepo, store: SampleStore, settings: dict[str, Any]
) -> dict[str, Any]:
    states = result.states
    culprit = None
    if result.outcome.value == "found":
        sha = states[result.hi].sha
        culprit = {**dataclasses.asdict(repo.info(sha)), "diffstat": repo.diffstat(sha)}
    conf = result.confirmation
    return {
        "version": REPORT_VERSION,
        "kind": "ft-bisect-report",
        "outcome": result.outcome.value,
        "message": result.message,
        "repo": str(repo.path),
        "range": {"good": states[0].sha, "bad": states[-1].sha, "commits": len(states)},
        "direction": result.direction,
        "settings": settings,
        "measure": store.config,
        "config_hash": store.config_hash,
        "patch_stack": {"digest": store.stack.digest(), "items": store.stack.describe()},
        "machine": store.record(states[0].sha)["machine"],
        "endpoints": _effect(result.endpoints),
        "culprit": culprit,
        "candidates": [_row(i, repo, store, result) for i in range(result.lo + 1, result.hi + 1)],
        "confirmation": None
        if conf is None
        else {"confirmed": conf.confirmed, "note": conf.note, "effect": _effect(conf.effect)},
        "samples_taken": result.taken,
        "commits": [
            _row(i, repo, store, result)
            for i, s in enumerate(states)
            if s.verdict is not None or store.values(s.sha)
        ],
    }


def _row(i: int, repo: UserRepo, store: SampleStore, result: BisectResult) -> dict[str, Any]:
    state = result.states[i]
    rec = store.record(state.sha)
    values = store.values(state.sha, "search")
    return {
        "index": i,
        "sha": state.sha,
        "subject": repo.info(state.sha).subject,
        "verdict": state.verdict.value if state.verdict else None,
        "median": median(values) if values else None,
        "spread": spread(values) if values else None,
        "n": len(values),
        "p_good": state.p_good,
        "p_bad": state.p_bad,
        "reason": state.reason,
        "applied": rec["applied"],
        "facts": rec.get("facts", {}),
        "samples": rec["samples"],
    }


def _effect(eff: Effect | None) -> dict[str, Any] | None:
    if eff is None:
        return None
    return {**dataclasses.asdict(eff), "relative": eff.relative, "text": eff.describe()}


def markdown(rep: dict[str, Any]) -> str:
    good, bad = rep["range"]["good"][:10], rep["range"]["bad"][:10]
    parts = [f"### `ft bisect {good}..{bad}`: {rep['outcome']}", "", rep["message"], ""]
    if rep["culprit"]:
        c = rep["culprit"]
        parts += [f"**{c['subject']}** (`{c['sha'][:10]}`), {c['author']}, {c['date']}", ""]
    worse = "higher" if rep["direction"] == "higher" else "lower"
    parts.append(f"Endpoints ({worse} is worse): {rep['endpoints']['text']}")
    conf = rep["confirmation"]
    if conf:
        eff = f": {conf['effect']['text']}" if conf["effect"] else ""
        parts.append(f"Last good -> first bad, {conf['note']}{eff}")
    parts.append("")
    if rep["culprit"]:
        parts += [details("diffstat", code_block(rep["culprit"]["diffstat"])), ""]
    parts += _startup_changes(rep)
    rows = [
        [
            r["index"],
            f"`{r['sha'][:10]}`",
            r["subject"][:60],
            "" if r["median"] is None else f"{r['median']:.4g}",
            "" if r["spread"] is None else f"{r['spread']:.3g}",
            r["n"],
            r["verdict"] or "",
            r["reason"] or "",
        ]
        for r in rep["commits"]
    ]
    table = md_table(["#", "commit", "subject", "median", "IQR", "n", "verdict", "note"], rows)
    parts += [table, "", details("how it was measured", code_block(_how(rep), "json"))]
    parts.append(f"\nPlot: `plot.png` beside this report. {rep['samples_taken']} samples taken.")
    return "\n".join(parts) + "\n"


def _startup_changes(rep: dict[str, Any]) -> list[str]:
    """The engine's startup lines that differ between the last good and the first bad commit:
    the comparison the seed's user did by hand to rule out a config change."""
    rows = {r["index"]: r for r in rep["commits"]}
    cands = [r["index"] for r in rep["candidates"]]
    before = rows.get(min(cands) - 1, {}).get("facts", {}).get("startup") if cands else None
    after = rows.get(max(cands), {}).get("facts", {}).get("startup") if cands else None
    if before is None or after is None:
        return []
    gone = [f"- {ln}" for ln in before if ln not in after]
    new = [f"+ {ln}" for ln in after if ln not in before]
    body = "\n".join(gone + new) or "(identical: the engine resolved the same config)"
    return [details("startup lines, last good -> first bad", code_block(body, "diff")), ""]


def _how(rep: dict[str, Any]) -> str:
    import json

    keep = ("measure", "settings", "patch_stack", "machine")
    return json.dumps({k: rep[k] for k in keep}, indent=2)


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.35 * rep["range"]["commits"]), 4))
    for r in rep["commits"]:
        ys = [s["value"] for s in r["samples"] if s["phase"] == "search"]
        color = COLORS.get(r["verdict"] or "", "black")
        ax.scatter([r["index"]] * len(ys), ys, s=12, alpha=0.5, color=color)
        if r["median"] is not None:
            ax.scatter([r["index"]], [r["median"]], marker="_", s=300, color=color)
    cands = [r["index"] for r in rep["candidates"]]
    if cands:
        ax.axvspan(min(cands) - 0.5, max(cands) + 0.5, color="tab:red", alpha=0.1)
    ax.set_xticks([r["index"] for r in rep["commits"]])
    ax.set_xticklabels([r["sha"][:7] for r in rep["commits"]], rotation=60, fontsize=7)
    ax.set_ylabel(rep["measure"].get("metric") or "figure")
    ax.set_title(f"ft bisect: {rep['message'][:80]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rep: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "report.json", rep)
    write_text_atomic(out / "report.md", markdown(rep))
    plot(rep, out / "plot.png")
