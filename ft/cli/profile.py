"""`ft profile show [PATH]`: what a bandwidth profile decides for each expert format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ft.profile import Profile, decide, load_profile

profile_app = typer.Typer(
    help="Bandwidth profiles (written by `ft bench bw`).", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(profile_app, name="profile")


@profile_app.command("show")
def show(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Profile file (default: $FT_CACHE_DIR/benchbw.json).", show_default=False
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print ratio, recommended strategy and hybrid fetch fraction for each expert format."""
    profile = load_profile(path)
    if json_out:
        typer.echo(json.dumps(decisions_json(profile), indent=2))
    else:
        render_profile(profile, Console())


def decisions_json(profile: Profile) -> dict[str, Any]:
    decisions = {}
    for fmt in profile.formats:
        d = decide(profile, fmt)
        decisions[fmt] = {
            "ratio": d.ratio,
            "recommended": d.recommended,
            "fetch_fraction": d.fetch_fraction,
            "note": d.note,
        }
    return {"path": str(profile.path), "threshold": profile.threshold, "decisions": decisions}


def render_profile(profile: Profile, console: Console) -> None:
    """The machine facts, then one table row per format (also used by `ft bench bw`)."""
    data = profile.data
    cpu, gpu, ceil = data["cpu"], data["gpu"], data["ceilings"]
    console.print(
        f"[bold]{profile.path}[/] (written {data['written']}, threshold {profile.threshold})"
    )
    console.print(
        f"CPU: {cpu['model']}, {cpu['physical_cores']} cores, {cpu['threads_used']} threads used,"
        f" isa {cpu['isa']}; host read {_gbs(ceil['cpu_stream_read_gbs'])}"
    )
    if gpu is None:
        console.print("GPU: none (PCIe not measured)")
    else:
        link = f"PCIe gen{gpu['pcie_gen']} x{gpu['pcie_width']}"
        h2d, d2h = _gbs(ceil["pcie_linear_h2d_gbs"]), _gbs(ceil["pcie_linear_d2h_gbs"])
        console.print(f"GPU: {gpu['name']}, {link}; H2D {h2d}, D2H {d2h}")
    if data.get("source"):
        console.print(f"[dim]source: {data['source']}[/]")
    table, notes = decisions_table(profile)
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)


def decisions_table(profile: Profile) -> tuple[Table, list[str]]:
    """One row per format, and the notes: numbered under the table, where a long note cannot
    wrap a row to many lines at 80 columns."""
    table = Table(title="Per expert format (GB/s; ratio = CPU MoE / PCIe gather)")
    for header in ("format", "CPU MoE", "PCIe gather", "ratio", "recommended", "fetch", "note"):
        right = header not in ("format", "recommended", "note")
        table.add_column(header, no_wrap=True, justify="right" if right else "left")
    notes: list[str] = []
    for fmt in profile.formats:
        kernel, d = profile.data["dtype_kernels"][fmt], decide(profile, fmt)
        if d.note:
            notes.append(f"[{len(notes) + 1}] {fmt}: {d.note}")
        table.add_row(
            fmt,
            _gbs(kernel["cpu_moe_gbs"], ""),
            _gbs(kernel["pcie_gather_gbs"], ""),
            "-" if d.ratio is None else f"{d.ratio:.2f}",
            f"[green]{d.recommended}[/]" if d.recommended == "hybrid" else d.recommended,
            "-" if d.fetch_fraction is None else f"{d.fetch_fraction:.1%}",
            f"[{len(notes)}]" if d.note else "",
        )
    return table, notes


def _gbs(value: float | None, unit: str = " GB/s") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"
