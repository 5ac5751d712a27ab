"""`ft bench llamacpp`: ft's decode tok/s beside llama.cpp's on the same checkpoint and the same
GPU memory budget, batch 1, one table with ratios.

    all on the GPU          ft resident                      llama.cpp -ngl 99
    a budget of G GiB       ft offload, hybrid (cache auto)  --n-cpu-moe N (fewest N that fit)
                                                             and -ot exps=CPU; ratio vs the best
    every expert on the CPU ft hybrid, fetch fraction 0      -ot exps=CPU

Before any timing, both engines decode the same prompt ids greedily and the table states how
many of the tokens agree (the same model, or not)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ft import __version__
from ft.bench import llamacpp
from ft.bench.decode import prompts
from ft.errors import FtError
from ft.report import md_table

Log = Callable[[str], None]


@dataclass(frozen=True)
class CompareConfig:
    build: str  # llama.cpp CMake build folder (or its bin/)
    model: str  # HF-layout checkpoint, unquantised: llama.cpp converts it (bf16, Q8_0)
    # int8 experts (`ft model synth --expert-format int8`, same preset): ft's int8 beside
    # llama.cpp's Q8_0 of `model`; timed, not checked (synth draws its dense weights anew)
    int8_model: str | None = None
    budget_gib: float | None = None  # None: only the all-on-the-GPU pair
    tokens: int = 64  # llama-bench -n; ft's timed decode steps
    repetitions: int = 3  # llama-bench -r
    warmup: int = 4  # ft's dropped decode steps
    device: str | None = None  # ft's --device (default: the engine's)
    threads: int | None = None  # llama-bench -t
    source: str | None = None  # llama.cpp source tree (default: from the build's CMakeCache)
    gguf_dir: str | None = None  # converted GGUFs, kept for the next run
    check_tokens: int = 16  # greedy tokens compared before timing

    def __post_init__(self) -> None:
        if self.budget_gib is not None and self.budget_gib <= 0:
            raise FtError(f"--gpu-memory-limit must be positive, got {self.budget_gib}")
        if min(self.tokens, self.repetitions, self.check_tokens) < 1 or self.warmup < 0:
            raise FtError("--tokens, --repetitions and --check-tokens must be >= 1, --warmup >= 0")
        for model in filter(None, (self.model, self.int8_model)):
            if not (Path(model) / "config.json").is_file():
                raise FtError(f"{model} has no config.json: not a checkpoint folder")

    @property
    def models(self) -> dict[str, str]:
        """ft's expert format -> the checkpoint ft runs it from."""
        return {"bf16": self.model, **({"int8": self.int8_model} if self.int8_model else {})}


# Each `ft bench decode` call: its flags, then per strategy it runs (group, label, the llama.cpp
# placement it faces; "best": the fastest placement measured for the budget). Strategies of one
# setting share a call, so the experts are loaded once for them.
def ft_runs(budget: float | None) -> list[tuple[list[str], dict[str, tuple[str, str, str]]]]:
    runs = [(["--strategies", "resident"], {"resident": ("all on the GPU", "resident", "gpu")})]
    if budget is None:
        return runs
    limit, group = ["--gpu-memory-limit", f"{budget:g}"], f"{budget:g} GiB budget"
    return runs + [
        (["--strategies", "offload,hybrid", *limit],
         {"offload": (group, "offload", "best"), "hybrid": (group, "hybrid", "best")}),
        (["--strategies", "hybrid", "--moe-hybrid-max-fetch", "0", *limit],
         {"hybrid": ("every expert on the CPU", "hybrid, fetch 0", "exps-cpu")}),
    ]  # fmt: skip


def run_compare(cfg: CompareConfig, log: Log = print, save=None) -> dict:
    """Convert, check, then time both engines; `save(report)` after every row, so that a run
    stopped at a time limit keeps what it measured."""
    lc = llamacpp.LlamaCpp.at(cfg.build, cfg.source)
    cache = Path(cfg.gguf_dir) if cfg.gguf_dir else Path(cfg.model).resolve().parent / "gguf"
    peer_rows, ft_rows, checks = [], [], []
    dtype, ours = _checkpoint_dtype(cfg.model), None
    for fmt in cfg.models:
        kind = llamacpp.gguf_type(fmt, dtype)
        gguf = llamacpp.convert(lc, cfg.model, kind, cache, log)
        ours = ours or _ft_greedy(cfg, _prompt(cfg), log)
        checks.append(_check_same_model(lc, cfg, kind, gguf, ours))
        sizes = llamacpp.gguf_sizes(lc, gguf)
        for name, args in _placements(sizes, cfg.budget_gib):
            log(f"llama-bench {gguf.name} {' '.join(args)}")
            row = llamacpp.llama_bench(lc, gguf, args, cfg.tokens, cfg.repetitions, cfg.threads)
            peer_rows.append({"format": fmt, "gguf_type": kind,
                              "placement": name, "args": args, "result": row,
                              "gguf_gib": sizes.total / llamacpp.GIB})  # fmt: skip
            _ = save and save(report(cfg, checks, peer_rows, ft_rows))
        for flags, runs in ft_runs(cfg.budget_gib):
            log(f"ft bench decode --model {cfg.models[fmt]} {' '.join(flags)}")
            for strategy, row in _ft_bench(cfg, fmt, flags).items():
                group, label, faces = runs[strategy]
                ft_rows.append({"format": fmt, "group": group, "run": label, "faces": faces,
                                **row})  # fmt: skip
            _ = save and save(report(cfg, checks, peer_rows, ft_rows))
    return report(cfg, checks, peer_rows, ft_rows)


def _checkpoint_dtype(model: str) -> str | None:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg.get("dtype") or cfg.get("torch_dtype")


def _placements(sizes, budget):
    gpu = llamacpp.placements(sizes, None)
    return gpu if budget is None else gpu + llamacpp.placements(sizes, budget)


def _prompt(cfg: CompareConfig) -> list[int]:
    from ft.engine.config import ModelConfig

    return prompts(ModelConfig.from_dir(cfg.model).vocab_size, 1, 16)[0]


def _check_same_model(lc, cfg: CompareConfig, kind: str, gguf: Path, ours: dict) -> dict:
    """llama.cpp's greedy ids on a GGUF of `model` beside ft's on `model` itself, from the same
    prompt ids; -> how many agree before the first difference."""
    theirs = llamacpp.greedy_ids(lc, gguf, ours["prompt"], cfg.check_tokens)
    return {"gguf_type": kind, "prompt": ours["prompt"], "ft": ours["ids"], "llamacpp": theirs,
            "agree": agreeing_prefix(ours["ids"], theirs), "of": cfg.check_tokens}  # fmt: skip


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """Greedy tokens that agree before the first difference (after it, the contexts differ)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _ft(cfg: CompareConfig, fmt: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "ft", *args, "--model", cfg.models[fmt]]
    cmd += ["--device", cfg.device] if cfg.device else []
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise FtError(f"ft {args[0]} {args[1] if len(args) > 1 else ''} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ft_greedy(cfg: CompareConfig, prompt: list[int], log: Log) -> dict:
    log(f"greedy check: {cfg.check_tokens} tokens from the same {len(prompt)} prompt ids")
    ids = ",".join(str(i) for i in prompt)
    out = _ft(cfg, "bf16", "generate", "--prompt-ids", ids, "--max-tokens",
              str(cfg.check_tokens), "--ignore-eos")  # fmt: skip
    return {"prompt": prompt, "ids": out["token_ids"]}


def _ft_bench(cfg: CompareConfig, fmt: str, flags: list[str]) -> dict[str, dict]:
    """strategy -> its row of one `ft bench decode` call."""
    out = _ft(cfg, fmt, "bench", "decode", *flags, "--tokens", str(cfg.tokens),
              "--warmup", str(cfg.warmup))  # fmt: skip
    return {
        row["strategy"]: {"tok_s": row.get("tok_s"), "error": row.get("error"), "flags": flags,
                          "cache_size": row.get("cache_size"), "device": out.get("device"),
                          "machine": out.get("machine")}
        for row in out["results"]
    }  # fmt: skip


def report(cfg: CompareConfig, checks: list[dict], peer_rows: list[dict], ft_rows: list[dict]):
    """The versioned JSON report: raw rows of both engines and the paired table."""
    first = peer_rows[0]["result"] if peer_rows else {}
    return {
        "version": 1,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model, "budget_gib": cfg.budget_gib, "tokens": cfg.tokens,
        "machine": {"gpu": first.get("gpu_info"), "cpu": first.get("cpu_info"),
                    "llamacpp_commit": first.get("build_commit"),
                    "llamacpp_backends": first.get("backends"), "ft": __version__},
        "same_model": checks, "llamacpp": peer_rows, "ft": ft_rows,
        "table": pair_rows(peer_rows, ft_rows),
    }  # fmt: skip


def pair_rows(peer_rows: list[dict], ft_rows: list[dict]) -> list[dict]:
    """Each ft run beside the llama.cpp placement it faces (of the same format pair); "best" is
    the fastest placement measured under the budget."""
    table = []
    for r in ft_rows:
        mine = [p for p in peer_rows if p["format"] == r["format"]]
        if r["faces"] == "best":
            mine = [p for p in mine if p["placement"] != "gpu"]
            faced = max(mine, key=lambda p: p["result"]["avg_ts"] or 0, default=None)
        else:
            faced = next((p for p in mine if p["placement"] == r["faces"]), None)
        peer_ts = faced["result"]["avg_ts"] if faced else None
        ratio = r["tok_s"] / peer_ts if r["tok_s"] and peer_ts else None
        table.append({
            "format": r["format"], "group": r["group"], "ft_run": r["run"],
            "ft_tok_s": r["tok_s"], "ft_error": r["error"],
            "llamacpp_type": faced["gguf_type"] if faced else None,
            "llamacpp_run": faced["placement"] if faced else None,
            "llamacpp_tok_s": peer_ts,
            "llamacpp_stddev": faced["result"]["stddev_ts"] if faced else None,
            "ratio": ratio,
        })  # fmt: skip
    return table


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def markdown(rep: dict) -> str:
    """The table people read: one row per ft run, beside the llama.cpp placement it faces."""
    heads = ("placement", "ft", "ft tok/s", "llama.cpp", "llama.cpp tok/s", "ft / llama.cpp")
    rows = [
        (t["group"], f"{t['ft_run']} ({t['format']})",
         _num(t["ft_tok_s"]) if t["ft_tok_s"] else f"- ({t['ft_error']})",
         f"{t['llamacpp_run']} ({t['llamacpp_type']})" if t["llamacpp_run"] else "-",
         f"{_num(t['llamacpp_tok_s'])} ± {_num(t['llamacpp_stddev'])}"
         if t["llamacpp_tok_s"] else "-",
         _num(t["ratio"], "{:.2f}x"))
        for t in rep["table"]
    ]  # fmt: skip
    m = rep["machine"]
    checks = "; ".join(f"{c['gguf_type']} {c['agree']} of {c['of']}" for c in rep["same_model"])
    return "\n".join([
        md_table(heads, rows), "",
        f"Decode at batch 1, {rep['tokens']} tokens; llama.cpp {m['llamacpp_commit']} "
        f"({m['llamacpp_backends']}), ft {m['ft']}; GPU {m['gpu'] or '-'}, CPU {m['cpu'] or '-'}.",
        f"Same model: greedy tokens of llama.cpp on each GGUF that agree with ft's on the "
        f"unquantised checkpoint: {checks}.",
    ])  # fmt: skip
