"""timeline.png: per-thread CPU %, GPU utilisation and tok/s over the run (matplotlib, Agg)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ft.probes.threads import POOL

TOP = 6  # threads drawn one by one; the CPU MoE pool is drawn as one summed line


def _cpu_series(recs, t0: float, roles: dict[int, tuple[str, str]]) -> dict[str, list]:
    """Per-thread (name, role by tid) CPU % lines, plus the pool's threads summed into one."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for rec in recs:
        pool = 0.0
        for th in rec["threads"]:
            name, role = roles.get(th["tid"], (th["comm"], ""))
            if "cpu_pct" not in th:
                continue
            if role == POOL:
                pool += th["cpu_pct"]
            else:
                series[f"{name} ({th['tid']})"].append((rec["t"] - t0, th["cpu_pct"]))
        series["CPU MoE pool (sum)"].append((rec["t"] - t0, pool))
    return series


def plot(path: Path, kinds: dict[str, list[dict]], roles: dict[int, tuple[str, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = kinds["threads"]
    t0 = recs[0]["t"] if recs else 0.0
    series = _cpu_series(recs, t0, roles)
    busiest = sorted(series, key=lambda k: -sum(v for _, v in series[k]))[:TOP]
    rates = [(r["t"] - t0, r["tok_s"]) for r in kinds["throughput"] if r.get("tok_s") is not None]
    rows = 3 if rates else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=True)
    for name in busiest:
        xs, ys = zip(*series[name], strict=True) if series[name] else ((), ())
        axes[0].plot(xs, ys, label=name)
    axes[0].set_ylabel("CPU % of a core")
    axes[0].legend(fontsize="small", loc="upper right")
    _gpu_axis(axes[1], kinds["gpu"], t0)
    if rows == 3:
        axes[2].plot(*zip(*rates, strict=True), color="tab:green")
        axes[2].set_ylabel("decode tok/s")
    _shade_workload(axes, kinds["phase"], t0, recs[-1]["t"] - t0 if recs else 0.0)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _shade_workload(axes, phases: list[dict], t0: float, t_end: float) -> None:
    """The span the findings look at, where the target marks one (engine mode)."""
    marks = {r["phase"]: r["t"] - t0 for r in phases}
    if "workload" not in marks:
        return
    for ax in axes:
        ax.axvspan(marks["workload"], marks.get("done", t_end), color="0.9", zorder=0)
    axes[0].set_title("shaded: the workload (findings use this span)", fontsize="small")


def _gpu_axis(ax, recs: list[dict], t0: float) -> None:
    pts = [
        (r["t"] - t0, d["util_pct"])
        for r in recs
        if r.get("available")
        for d in r["devices"][:1]
        if d.get("util_pct") is not None
    ]
    if pts:
        ax.plot(*zip(*pts, strict=True), color="tab:red")
    else:
        reason = next((r.get("reason") for r in recs if r.get("reason")), "no samples")
        ax.text(
            0.5, 0.5, f"GPU unavailable: {reason}", ha="center", va="center", transform=ax.transAxes
        )
    ax.set_ylabel("GPU util %")
    ax.set_ylim(0, 105)
