"""`ft bench decode`: decode tok/s per strategy and batch, beside the roofline of the same run.

The checkpoint's experts are loaded into host memory ONCE and every strategy's engine is built
on that store (the 48-layer qwen3-30b-a3b preset is ~58 GB). Per (strategy, batch): `batch`
seeded prompts, greedy, `warmup` decode steps dropped, then `tokens` decode steps timed one by
one; each step's bytes per link come from the engine's counters (roofline.py has the formulas).
"""

from __future__ import annotations

import gc
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from ft import __version__, cpuinfo
from ft.bench.roofline import Bandwidths, StepBytes, bandwidths, roofline
from ft.engine.config import STRATEGIES, EngineConfig, torch_dtype
from ft.engine.strategies.hybrid import ROUND_TRIP
from ft.errors import FtError

COUNTERS = (
    "cache_hits", "cache_misses", "experts_fetched", "bytes_fetched", "experts_cpu",
    "experts_cpu_inline", "expert_uses", "experts_prefetched", "prefetch_hits",
    "experts_in_place", "cpu_layers", *(f"cpu_{part}_us" for part in ROUND_TRIP),
)  # fmt: skip
PEERS = ("accelerate",)
Progress = Callable[[str, int], None]  # (what is running, steps done) for a progress bar


def available_strategies() -> tuple[str, ...]:
    """What this build's engine runs, in bench order (hybrid only where the engine has it)."""
    return tuple(s for s in ("resident", "offload", "hybrid") if s in STRATEGIES)


@dataclass(frozen=True)
class DecodeBenchConfig:
    # the settings every run shares, resolved once (device, dtype, expert format); each run
    # sets its strategy, and the bench its batch and KV size (`engine_for`)
    engine: EngineConfig
    strategies: tuple[str, ...] = ("resident", "offload")
    batches: tuple[int, ...] = (1,)
    tokens: int = 32  # timed decode steps per (strategy, batch)
    warmup: int = 4  # decode steps dropped first
    prompt_len: int = 16
    profile: str | None = None  # bandwidth profile path; None: the default one if present
    peer: str | None = None  # "accelerate": add the transformers + accelerate baseline
    trace: str | None = None  # folder: profile a few extra decode steps per run (decode_trace)

    def __post_init__(self) -> None:
        known = available_strategies()
        bad = [s for s in self.strategies if s not in known]
        if bad or not self.strategies:
            raise FtError(f"--strategies: {', '.join(bad) or '(none)'} not in {', '.join(known)}")
        if not self.batches or min(self.batches) < 1:
            raise FtError(f"--batch sizes must be at least 1, got {list(self.batches)}")
        if self.tokens < 1 or self.warmup < 0 or self.prompt_len < 1:
            raise FtError("--tokens and the prompt length must be >= 1, --warmup >= 0")
        if self.peer is not None and self.peer not in PEERS:
            raise FtError(f"--peer {self.peer!r}: known peers are {', '.join(PEERS)}")

    @property
    def total_steps(self) -> int:
        runs = len(self.strategies) + (1 if self.peer else 0)
        return runs * len(self.batches) * (self.warmup + self.tokens)

    def engine_for(self, strategy: str) -> EngineConfig:
        """The engine of one run: the shared settings, this strategy (resident takes no cache
        and no gates), KV room for the bench's prompts and steps at its largest batch."""
        offloads = strategy != "resident"
        return replace(
            self.engine, moe_strategy=strategy,
            moe_cache_rate=self.engine.moe_cache_rate if offloads else None,
            moe_gates=self.engine.moe_gates if offloads else None,
            max_num_seqs=max(self.batches),
            max_model_len=self.prompt_len + self.warmup + self.tokens + 8,
        )  # fmt: skip


def run_decode_bench(cfg: DecodeBenchConfig, progress: Progress = lambda *_: None) -> dict:
    base = cfg.engine
    progress("loading experts into host memory", 0)
    store, shape = _load_store(base)
    bw = bandwidths(base.device, _profile_data(cfg.profile), quick=base.device == "cpu")
    results = []
    for strategy in cfg.strategies:
        results += _run_strategy(cfg, base, strategy, store, shape, bw, progress)
    del store
    _release_host_memory()  # the peer loads the checkpoint again: give the host memory back
    if cfg.peer:
        from ft.bench.peer import run_accelerate

        same = {b: prompts(shape.vocab_size, b, cfg.prompt_len) for b in cfg.batches}
        results += run_accelerate(cfg, base, same, progress)
    return _report(cfg, base, bw, shape, results)


def _release_host_memory() -> None:
    gc.collect()
    if not torch.cuda.is_available():
        return
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):  # torch 2.13 / older
        if hasattr(torch._C, name):  # freed pinned blocks stay cached until emptied
            getattr(torch._C, name)()
            return


def _load_store(base):
    from ft.engine.config import ModelConfig
    from ft.engine.model.loader import CheckpointReader, load_experts

    shape = ModelConfig.from_dir(base.model)
    return load_experts(CheckpointReader(base.model), shape, torch_dtype(base.dtype)), shape


def _profile_data(path: str | None) -> dict | None:
    from ft.profile import default_path, load_profile

    if path is None and not default_path().is_file():
        return None  # no profile yet: the bench still runs, with a note
    return load_profile(path).data


def _run_strategy(cfg, base, strategy, store, shape, bw, progress) -> list[dict]:
    progress(f"{strategy}: building the engine", 0)
    try:
        engine = _engine(cfg, base, strategy, store)
    except (FtError, torch.cuda.OutOfMemoryError) as exc:
        progress(f"{strategy}: skipped", len(cfg.batches) * (cfg.warmup + cfg.tokens))
        return [_failed(strategy, b, exc) for b in cfg.batches]
    try:
        rows = []
        for b in cfg.batches:
            try:
                rows.append(_measure(engine, strategy, b, cfg, shape, store, bw, progress))
            except torch.cuda.OutOfMemoryError as exc:  # this batch and larger ones do not fit
                return rows + [_failed(strategy, later, exc) for later in cfg.batches[len(rows) :]]
        if cfg.trace:
            _trace(engine, strategy, rows, cfg, shape)
        return rows
    finally:
        engine.close()
        del engine
        gc.collect()
        if base.device == "cuda":
            torch.cuda.empty_cache()


def _engine(cfg, base, strategy: str, store):
    from ft.engine.runner import LLMEngine

    # the one host copy of the experts, shared
    return LLMEngine(cfg.engine_for(strategy), expert_store=store)


def _trace(engine, strategy: str, rows: list[dict], cfg, shape) -> None:
    from ft.bench.decode_trace import trace_decode

    for row in rows:
        batch_prompts = prompts(shape.vocab_size, row["batch"], cfg.prompt_len)
        name = f"{strategy}-b{row['batch']}"
        row["trace"] = trace_decode(engine, batch_prompts, Path(cfg.trace), name)


def _failed(strategy: str, batch: int, exc: BaseException) -> dict:
    return {"strategy": strategy, "batch": batch, "tok_s": None, "error": str(exc).split("\n")[0]}


def prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    """Fixed, seeded prompts: every strategy and the peer decode the same ones."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def _measure(engine, strategy, batch, cfg, shape, store, bw, progress) -> dict:
    from ft.engine.model.sampling import SamplingParams

    params = SamplingParams(max_tokens=cfg.warmup + cfg.tokens + 1, ignore_eos=True)
    for prompt in prompts(shape.vocab_size, batch, cfg.prompt_len):
        engine.add_request(prompt, params)
    steps, decoded = [], 0
    while engine.has_unfinished():
        engine.step()
        last = engine.last_step
        if last.get("phase") != "decode" or last["tokens"] != batch:
            continue
        decoded += 1
        if decoded > cfg.warmup:
            steps.append({**last, "context": batch * (cfg.prompt_len + decoded)})
        progress(f"{strategy} batch {batch}", 1)
    return _summarise(engine, strategy, batch, steps, shape, store, bw)


def _summarise(engine, strategy, batch, steps, shape, store, bw: Bandwidths) -> dict:
    seconds = [s["seconds"] for s in steps]
    per_step = {k: statistics.fmean(s.get(k, 0) for s in steps) for k in COUNTERS}
    cpu_experts = per_step["experts_cpu"] + per_step["experts_cpu_inline"]
    off_hbm = cpu_experts + per_step["experts_in_place"]  # computed from host memory
    kv = kv_bytes_per_token(shape, engine) * statistics.fmean(s["context"] for s in steps)
    step = StepBytes(
        hbm=dense_read_bytes(engine.model)
        + (per_step["expert_uses"] - off_hbm) * store.expert_bytes
        + kv,
        pcie=per_step["bytes_fetched"],  # copies into slots and experts read in place
        host=cpu_experts * store.expert_bytes,
    )
    tok_s = batch * len(steps) / sum(seconds)
    roof = roofline(step, bw, batch)
    return {
        "strategy": strategy, "batch": batch, "kernel": engine.strategy.kernel,
        "cache_size": engine.moe_cache_size, "steps": len(steps), "tok_s": tok_s,
        "step_ms_median": 1e3 * statistics.median(seconds),
        "step_ms": [round(1e3 * s, 3) for s in seconds],
        "per_step": {**per_step, "hbm_bytes": step.hbm, "pcie_bytes": step.pcie,
                     "host_bytes": step.host, "expert_bytes": store.expert_bytes},
        "roofline": roof, "ratio": tok_s / roof["tok_s"] if roof["tok_s"] else None,
        "error": None,
    }  # fmt: skip


def dense_read_bytes(model) -> int:
    """Weights every decode step reads whole: each layer's dense tensors, final norm, LM head
    (the embedding table is read one row per token: left out unless tied to the LM head)."""
    tensors = {t.data_ptr(): t for layer in model.layers for t in layer.w.values()}
    tensors.update({t.data_ptr(): t for t in (model.norm, model.lm_head)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes_per_token(shape, engine) -> int:
    """K + V bytes of one cached token, all layers (what attention reads per context token)."""
    elem = engine.model.layers[0].k_cache.element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * elem


def _report(cfg, base, bw: Bandwidths, shape, results) -> dict:
    gpu = torch.cuda.get_device_name() if base.device == "cuda" else None
    return {
        "version": 1,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": base.model,
        "device": base.device,
        "dtype": base.dtype,
        "expert_format": base.expert_format,
        "machine": {"gpu": gpu, "cpu": cpuinfo.model_name(), "torch": torch.__version__,
                    "ft": __version__},
        "config": asdict(cfg),
        "bandwidth": bw.to_dict(),
        "results": results,
        "statistic": "tok/s = tokens / sum of timed step seconds; step_ms raw samples kept",
    }  # fmt: skip
