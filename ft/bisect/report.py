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
from ft.bisect.verdict import Outcome
from ft.report import code_block, details, md_table, write_json_atomic, write_text_atomic

REPORT_VERSION = 3  # 2: exit_code and suspect; 3: cluster, nodes and rows' nodes (--ray)
NODE_MARKERS = "osv^<>Dph*"  # a marker per Ray node in the plot
COLORS = {"good": "tab:green", "bad": "tab:red", "unknown": "tab:orange", "skip": "tab:gray"}


def build(
    result: BisectResult,
    repo: UserRepo,
    store: SampleStore,
    settings: dict[str, Any],
    cluster: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`cluster`: the Ray cluster that measured (RayWorkers.describe), if one did."""
    states, jobs = result.states, settings.get("jobs", 1)
    narrowed = result.hi - result.lo == 1 and result.confirmation is not None
    suspect = _commit(repo, states[result.hi].sha) if narrowed else None
    conf = result.confirmation
    return {
        "version": REPORT_VERSION,
        "kind": "ft-bisect-report",
        "outcome": result.outcome.value,
        "exit_code": result.outcome.exit_code,
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
        "culprit": suspect if result.outcome == Outcome.FOUND else None,  # confirmed only
        "suspect": suspect,  # where the search narrowed to one commit, confirmed or not
        "candidates": [
            _row(i, repo, store, result, jobs) for i in range(result.lo + 1, result.hi + 1)
        ],
        "confirmation": None
        if conf is None
        else {"confirmed": conf.confirmed, "note": conf.note, "effect": _effect(conf.effect)},
        "samples_taken": result.taken,
        "cluster": cluster,
        "nodes": _nodes(store, states[0].sha, states[-1].sha, jobs) if cluster else None,
        "commits": [
            _row(i, repo, store, result, jobs)
            for i, s in enumerate(states)
            if s.verdict is not None or store.values(s.sha)
        ],
    }


def _commit(repo: UserRepo, sha: str) -> dict[str, Any]:
    return {**dataclasses.asdict(repo.info(sha)), "diffstat": repo.diffstat(sha)}


def _row(
    i: int, repo: UserRepo, store: SampleStore, result: BisectResult, jobs: int
) -> dict[str, Any]:
    """One commit: median, spread and n of every sample taken under this run's conditions
    (search and confirmation); `samples` keeps every raw sample, of earlier runs too."""
    state = result.states[i]
    rec = store.record(state.sha)
    values = store.values(state.sha, jobs=jobs)
    return {
        "index": i,
        "sha": state.sha,
        "subject": repo.info(state.sha).subject,
        "verdict": state.verdict.value if state.verdict else None,
        "median": median(values) if values else None,
        "spread": spread(values) if values else None,
        "n": len(values),
        "n_confirm": len(store.values(state.sha, "confirm", jobs=jobs)),
        "p_good": state.p_good,
        "p_bad": state.p_bad,
        "reason": state.reason,
        "applied": rec["applied"],
        "facts": rec.get("facts", {}),
        "nodes": _by_node(rec["samples"], jobs),
        "samples": rec["samples"],
    }


def _by_node(samples: list[dict[str, Any]], jobs: int) -> dict[str, Any]:
    """Median and n of a commit's samples on each Ray node (empty without --ray)."""
    values: dict[str, list[float]] = {}
    for s in samples:
        if s.get("node") and s["jobs"] == jobs:
            values.setdefault(s["node"], []).append(s["value"])
    return {k: {"median": median(v), "n": len(v)} for k, v in sorted(values.items())}


def _nodes(store: SampleStore, good: str, bad: str, jobs: int) -> list[dict[str, Any]]:
    """Each node's own endpoints: what its commits were compared with."""
    g = _by_node(store.record(good)["samples"], jobs)
    b = _by_node(store.record(bad)["samples"], jobs)
    who = {**store.record(good)["nodes"], **store.record(bad)["nodes"]}
    return [
        {
            "key": k,
            "host": who.get(k, {}).get("host"),
            "gpu": who.get(k, {}).get("gpu"),
            "cpu": who.get(k, {}).get("cpu"),
            "good": g.get(k, {}).get("median"),
            "bad": b.get(k, {}).get("median"),
            "n_good": g.get(k, {}).get("n", 0),
            "n_bad": b.get(k, {}).get("n", 0),
        }
        for k in sorted({*g, *b})
    ]


def _effect(eff: Effect | None) -> dict[str, Any] | None:
    if eff is None:
        return None
    return {**dataclasses.asdict(eff), "relative": eff.relative, "text": eff.describe()}


def markdown(rep: dict[str, Any]) -> str:
    good, bad = rep["range"]["good"][:10], rep["range"]["bad"][:10]
    title = f"### `ft bisect {good}..{bad}`: {rep['outcome']} (exit {rep['exit_code']})"
    parts = [title, "", rep["message"], ""]
    if c := rep["suspect"]:
        label = "" if rep["culprit"] else "Suspect, **not confirmed**: "
        parts += [f"{label}**{c['subject']}** (`{c['sha'][:10]}`), {c['author']}, {c['date']}", ""]
    worse = f"{figure_name(rep['measure'])}, {rep['direction']} is worse"
    parts.append(f"Endpoints ({worse}): {rep['endpoints']['text']}")
    conf = rep["confirmation"]
    if conf:
        eff = f": {conf['effect']['text']}" if conf["effect"] else ""
        parts.append(f"Last good -> first bad, {conf['note']}{eff}")
    parts.append("")
    if rep["suspect"]:
        parts += [details("diffstat", code_block(rep["suspect"]["diffstat"])), ""]
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
    parts += [table, "", "n: every sample of the commit, the search's and the confirmation's."]
    parts += _cluster(rep)
    parts += ["", details("how it was measured", code_block(_how(rep), "json"))]
    parts.append(f"\nPlot: `plot.png` beside this report. {rep['samples_taken']} samples taken.")
    return "\n".join(parts) + "\n"


def _cluster(rep: dict[str, Any]) -> list[str]:
    """Under --ray: the cluster, and each node's own endpoints and commits."""
    cluster = rep.get("cluster")
    if not cluster:
        return []
    alive = [n for n in cluster["nodes"] if n["alive"]]
    head = (
        f"Measured on a Ray {cluster['ray']} cluster ({cluster['address']}): "
        f"{len(alive)} nodes, {cluster['gpus']:g} GPUs, {cluster['per_job']} per measurement. "
        "Each commit is compared only with the endpoints measured on its own node:"
    )
    commits = {
        n["key"]: ", ".join(
            f"`{r['sha'][:7]}`" for r in rep["commits"] if n["key"] in r["nodes"] and
            r["sha"] not in (rep["range"]["good"], rep["range"]["bad"])
        )
        for n in rep["nodes"]
    }  # fmt: skip
    rows = [
        [n["key"], n["gpu"] or "", (n["cpu"] or "")[:40], _num(n["good"]), n["n_good"],
         _num(n["bad"]), n["n_bad"], commits[n["key"]]]
        for n in rep["nodes"]
    ]  # fmt: skip
    headers = ["node", "GPU", "CPU", "GOOD median", "n", "BAD median", "n", "commits measured"]
    return ["", head, "", md_table(headers, rows)]


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def figure_name(measure: dict[str, Any]) -> str:
    """What was measured, in the user's own words: the engine figure, --metric or --run."""
    if measure.get("judge") == "engine":
        return str(measure.get("figure"))
    if measure.get("metric"):
        return str(measure["metric"])
    command = str(measure.get("command"))
    return f"`{command if len(command) <= 40 else command[:37] + '...'}`"


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

    jobs = rep["settings"].get("jobs", 1)
    nodes = [n["key"] for n in rep.get("nodes") or []]
    marks = {k: NODE_MARKERS[i % len(NODE_MARKERS)] for i, k in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * rep["range"]["commits"]), 4))
    for r in rep["commits"]:
        color = COLORS.get(r["verdict"] or "", "black")
        for phase, dx, fill in (("search", 0, color), ("confirm", 0.2, "none")):
            for node in nodes or [None]:  # a marker per node: their figures may differ
                marker = marks[node] if node else ("o" if phase == "search" else "D")
                ys = [s["value"] for s in r["samples"] if s["phase"] == phase
                      and s["jobs"] == jobs and s.get("node") == node]  # fmt: skip
                ax.scatter([r["index"] + dx] * len(ys), ys, s=14, alpha=0.6, marker=marker,
                           edgecolors=color, facecolors=fill)  # fmt: skip
        if r["median"] is not None:
            ax.scatter([r["index"]], [r["median"]], marker="_", s=300, color=color)
    cands = [r["index"] for r in rep["candidates"]]
    if cands:
        ax.axvspan(min(cands) - 0.5, max(cands) + 0.5, color="tab:red", alpha=0.1)
    if nodes:
        for node in nodes:
            ax.scatter([], [], marker=marks[node], color="gray", label=f"node {node}")
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray",
                   label="open: confirmation")  # fmt: skip
    else:
        ax.scatter([], [], marker="o", color="gray", label="search sample")
        ax.scatter([], [], marker="D", facecolors="none", edgecolors="gray", label="confirmation")
    ax.legend(fontsize=7, loc="best")
    ax.set_xticks([r["index"] for r in rep["commits"]])
    ax.set_xticklabels([r["sha"][:7] for r in rep["commits"]], rotation=60, fontsize=7)
    ax.set_ylabel(axis_label(rep).replace(" (", "\n("), fontsize=8)  # two lines: it fits
    ax.set_title(f"ft bisect: {rep['outcome']}: {rep['message'][:70]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def axis_label(rep: dict[str, Any]) -> str:
    return f"{figure_name(rep['measure']).strip('`')} ({rep['direction']} is worse)"


def write(rep: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "report.json", rep)
    write_text_atomic(out / "report.md", markdown(rep))
    plot(rep, out / "plot.png")
