"""`ft bisect GOOD..BAD`: find the commit that made a measured figure worse."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

_ENGINE = "Engine mode (default when --run is not given)"


def register(app: typer.Typer) -> None:
    app.command("bisect")(bisect_cmd)


def bisect_cmd(
    range_: Annotated[
        str | None,
        typer.Argument(
            metavar="GOOD..BAD",
            help="A known-good revision and a known-bad one (any bad one, not necessarily the "
            "first). Which way is worse, higher or lower, is read from their measurements.",
        ),
    ] = None,
    repo: Annotated[Path, typer.Option("--repo", help="The git repository (read only).")] = Path(
        "."
    ),
    run: Annotated[
        str | None,
        typer.Option(
            "--run",
            help="Shell command run in each commit's worktree; prints the "
            "figure on its last line (or JSON, see --metric). Exit 125 = skip.",
        ),
    ] = None,  # fmt: skip
    metric: Annotated[
        str | None, typer.Option("--metric", help="Key (a.b for nested) of the JSON figure.")
    ] = None,
    pick: Annotated[
        list[str] | None,
        typer.Option("--pick", help="Cherry-pick REV onto every commit that lacks it."),
    ] = None,
    patch: Annotated[
        list[Path] | None, typer.Option("--patch", help="Apply FILE (git apply) to every commit.")
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Samples per commit to start.")] = 3,
    max_repeats: Annotated[
        int, typer.Option("--max-repeats", help="Cap when doubling an undecided commit.")
    ] = 24,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            help="Commits measured at once, one worker each (a GPU each in engine mode); every "
            "worker measures both endpoints itself, so compared samples share conditions.",
        ),
    ] = 1,
    max_skips: Annotated[
        int, typer.Option("--max-skips", help="Stop after more unmeasurable commits.")
    ] = 6,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds for one --run measurement.")
    ] = 600.0,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the last run (or the one in --out).")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="State and report dir (default: in the cache).")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Model for `ft serve`.", rich_help_panel=_ENGINE)
    ] = None,
    serve_args: Annotated[
        str,
        typer.Option(
            "--serve-args",
            help="Engine flags for `ft serve`, e.g. '--moe-strategy hybrid'.",
            rich_help_panel=_ENGINE,
        ),
    ] = "",  # fmt: skip
    prompts: Annotated[int, typer.Option(help="Workload prompts.", rich_help_panel=_ENGINE)] = 8,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens per request.", rich_help_panel=_ENGINE)
    ] = 64,
    concurrency: Annotated[
        int, typer.Option(help="Requests in flight.", rich_help_panel=_ENGINE)
    ] = 1,
    figure: Annotated[
        str,
        typer.Option(
            help="WorkloadResult field: e2e_decode_tok_s, engine_decode_tok_s, ttft_s.",
            rich_help_panel=_ENGINE,
        ),
    ] = "e2e_decode_tok_s",  # fmt: skip
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Measure on a Ray cluster: `local` (start one here), `auto`, "
            "`ray://host:10001` or `host:6379`; --jobs is then the measurements in flight "
            "across it, and each node is compared only with itself (needs freetoken[ray]).",
            rich_help_panel="Ray",
        ),
    ] = None,
    cpus_per_job: Annotated[
        float,
        typer.Option(
            "--cpus-per-job",
            help="With --ray and --run: the CPUs one measurement holds (engine mode: 1 GPU).",
            rich_help_panel="Ray",
        ),
    ] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report JSON.")] = False,
) -> None:
    """Find the commit that made a figure worse: endpoints first, rank tests, a patch stack.

    Exit codes: 0 found (confirmed), 1 error, 2 range (skipped commits in the way),
    3 unconfirmed, 4 ambiguous, 5 no change between GOOD and BAD, 130 interrupted
    (docs/bisect.md).
    """
    from ft.bisect.config import BisectConfig
    from ft.bisect.driver import BisectOptions, EngineOptions, bisect, resume_options
    from ft.bisect.measure import Interrupted

    if range_ is None:
        if not resume:
            raise typer.BadParameter("give GOOD..BAD (or --resume)")
        opts = resume_options(str(out) if out else None)
    else:
        opts = BisectOptions(
            range=range_,
            repo=str(repo.resolve()),
            run=run,
            metric=metric,
            picks=tuple(pick or ()),
            patches=tuple(str(p.resolve()) for p in patch or ()),
            timeout_s=timeout,
            search=BisectConfig(repeats, max_repeats, jobs, max_skips),
            engine=EngineOptions(model, serve_args, prompts, max_tokens, concurrency, figure),
            out=str(out.resolve()) if out else None,
            ray=ray,
            cpus_per_job=cpus_per_job,
        )
    console = Console(stderr=True, highlight=False)
    start = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops as cleanly as Ctrl-C
    try:
        with console.status("checking the range", spinner="dots") as status:

            def log(msg: str) -> None:  # a line per event, the latest one beside the spinner
                console.print(f"[dim]{time.monotonic() - start:7.1f}s[/dim] {msg}", soft_wrap=True)
                status.update(msg)

            rep = bisect(opts, log)
    except (KeyboardInterrupt, Interrupted):
        console.print("error: interrupted; every finished sample is saved: run the same "
                      "command again (or `ft bisect --resume`) to continue")  # fmt: skip
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(rep, indent=2))
    else:
        _render(rep)
    if rep["exit_code"]:
        raise typer.Exit(rep["exit_code"])


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


_STYLE = {"good": "green", "bad": "red", "skip": "dim", "unknown": "yellow"}


def _render(rep: dict[str, Any]) -> None:
    """The table, then the verdict: the same words as report.md, and the exit code beside."""
    from ft.bisect.report import figure_name

    console = Console(highlight=False)
    figure = figure_name(rep["measure"]).strip("`")
    table = Table(title=f"ft bisect: {figure} ({rep['direction']} is worse)")
    headers = ("#", "commit", "median", "IQR", "n", "verdict")
    rows = [
        [
            str(r["index"]), r["sha"][:10],
            "" if r["median"] is None else f"{r['median']:.4g}",
            "" if r["spread"] is None else f"{r['spread']:.3g}",
            str(r["n"]), r["verdict"] or "",
        ]
        for r in rep["commits"]
    ]  # fmt: skip
    widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(headers)]
    for header, width in zip(headers, widths, strict=True):
        right = header in ("#", "median", "IQR", "n")
        table.add_column(header, justify="right" if right else "left", min_width=width)
    # the subject gets what the numbers leave of the line (rich would squeeze them instead)
    room = console.width - sum(w + 3 for w in widths) - 4
    table.add_column("subject", no_wrap=True, overflow="ellipsis", max_width=max(12, room))
    for r, row in zip(rep["commits"], rows, strict=True):
        table.add_row(*row, r["subject"], style=_STYLE.get(r["verdict"] or ""))
    console.print(table)
    for r in rep["commits"]:
        if r["reason"]:
            console.print(f"  {r['sha'][:10]} {r['verdict']}: {r['reason']}", style="dim")
    console.print(f"endpoints: {rep['endpoints']['text']}")
    if rep.get("cluster"):
        from ft.bisect.driver import cluster_line

        console.print(cluster_line(rep["cluster"]), style="dim")
        for n in rep["nodes"]:  # each node's own endpoints: what its commits were compared with
            good = "" if n["good"] is None else f"{n['good']:.4g}"
            bad = "" if n["bad"] is None else f"{n['bad']:.4g}"
            console.print(f"  node {n['key']}: good {good} (n={n['n_good']}), bad {bad} "
                          f"(n={n['n_bad']})", style="dim")  # fmt: skip
    if rep["confirmation"]:
        console.print(f"last good -> first bad: {rep['confirmation']['note']}")
    colour = "green" if rep["outcome"] == "found" else "yellow"
    console.print(f"[bold {colour}]{rep['message']}[/]")
    if c := rep["suspect"]:
        label = "" if rep["culprit"] else "suspect, not confirmed: "
        console.print(f"  {label}{c['subject']}\n  {c['author']}, {c['date']}")
        console.print(c["diffstat"])
    console.print(f"report: {rep['out']}/report.md, report.json, plot.png")
    console.print(f"outcome: {rep['outcome']} (exit {rep['exit_code']})", style="dim")
