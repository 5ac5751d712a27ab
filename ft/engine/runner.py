"""LLMEngine: load once, then `step()` = schedule -> run -> postprocess. Driven from one thread."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ft.engine.builder import build_engine_parts
from ft.engine.config import EngineConfig
from ft.engine.model.attention import Batch, Span
from ft.engine.model.sampling import SamplingParams, sample
from ft.engine.scheduler import Scheduler, Sequence, StepOutput
from ft.engine.strategies import decode_plan
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.engine")

__all__ = ["EngineStats", "LLMEngine", "SamplingParams", "StepOutput"]


@dataclass
class EngineStats:
    """Cumulative counters. cache_hits + cache_misses == expert_uses (routed (layer, expert)
    pairs, counted once per layer per forward)."""

    prefill_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_tokens: int = 0
    decode_time_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    experts_fetched: int = 0
    experts_in_place: int = 0  # read from host memory by the device (a copy past its bound)
    bytes_fetched: int = 0  # expert bytes over PCIe: copies and reads in place
    experts_to_cpu: int = 0  # misses a hybrid strategy handed to the CPU (pool or not)
    experts_cpu: int = 0
    experts_cpu_inline: int = 0
    expert_uses: int = 0
    steps: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, expert_store=None):
        """`expert_store`: reuse a HostExpertStore loaded before (ft bench decode); None loads."""
        parts = build_engine_parts(config, expert_store)
        self.config = parts.config  # as resolved: `auto` shows the strategy it chose
        self.model_config, self.model, self.strategy = (
            parts.model_config,
            parts.model,
            parts.strategy,
        )
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.moe_cache_size = parts.cache_size  # device expert slots; None when resident
        self.model_name = Path(config.model).resolve().name
        self.device = torch.device(config.device)
        running = min(parts.num_slots, config.max_num_seqs)
        self.scheduler = Scheduler(running, self.max_model_len, parts.stop_token_ids)
        self._ids = itertools.count()
        self._aborted: list[StepOutput] = []
        self._stats = EngineStats()
        self.last_step: dict = {}  # per-step counters of the latest step (hits, misses, bytes...)
        self.graphs = self._decode_graphs(running)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        self._check_prompt(prompt_ids)
        seq = Sequence(next(self._ids), list(prompt_ids), params, params.generator())
        self.scheduler.add(seq)
        return seq.seq_id

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise FtError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            n, limit = len(prompt_ids), self.max_model_len
            raise FtError(f"prompt of {n} tokens leaves no room in max_model_len {limit}")
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise FtError(f"prompt token ids must be in [0, {vocab})")

    def step(self) -> list[StepOutput]:
        outputs, self._aborted = self._aborted, []
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        start, before = time.perf_counter(), self.strategy.counters()
        token_ids = self._run(seqs, is_prefill)
        self._account(seqs, is_prefill, time.perf_counter() - start, before)
        return outputs + self.scheduler.postprocess(seqs, token_ids)

    def _decode_graphs(self, max_batch: int):
        """CUDA graphs for decode as the plan says (none: eager)."""
        strategy, mode = self.strategy, decode_plan(self.config).graphs
        if mode == "eager":
            return None
        from ft.engine.graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, strategy, max_batch, self.max_model_len, self.device)
        per = "stretch between MoE layers' host stops" if mode == "stretch" else "step"
        keys = "" if graphs.bucket == self.max_model_len else f" and {graphs.bucket}-key bucket"
        how = ""
        if mode == "follow":
            how = " (device gates: each MoE layer waits on the GPU until the host has fetched its "
            how += "misses; no host sync or launch per layer)"
        log.info(f"CUDA graphs: decode captured per {per}, batch size{keys}{how}")
        if self.strategy.prefetch_depth:  # only the graphed stops prefetch
            single, batched = self.strategy.prefetch_depths
            window, flag = self.strategy.cache.window, self.config.moe_prefetch_depth
            ahead = f"{single} layers ahead"
            ahead += "" if single == batched else f" at batch 1, {batched} above"
            queued = f"at most {window} queued" if window else "all queued"
            log.info(
                f"MoE prefetch: guesses {ahead}, {queued} for copy at once "
                f"(--moe-prefetch-depth {flag}, --moe-prefetch-window {window})"
            )
        return graphs

    def _run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        batch = self._batch(seqs, is_prefill)
        if self.graphs and not is_prefill and self.graphs.fits(len(seqs)):
            logits = self.graphs.logits(batch)
        else:
            logits = self.model.forward(batch)  # [B, V]
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    def _batch(self, seqs: list[Sequence], is_prefill: bool) -> Batch:
        if is_prefill:
            spans = [Span(s.slot, 0, len(s.prompt_ids)) for s in seqs]
            tokens = [t for s in seqs for t in s.prompt_ids]
            positions = [p for s in seqs for p in range(len(s.prompt_ids))]
        else:
            spans = [Span(s.slot, s.num_tokens - 1, 1) for s in seqs]
            tokens = [s.output_ids[-1] for s in seqs]
            positions = [s.num_tokens - 1 for s in seqs]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return Batch(
            as_tensor(tokens), as_tensor(positions), spans, as_tensor([s.slot for s in seqs])
        )

    def _account(self, seqs: list[Sequence], is_prefill: bool, seconds: float, before) -> None:
        after = self.strategy.counters()
        self.last_step = {k: after[k] - before[k] for k in after}  # this step's counters
        self.last_step.update(phase="prefill" if is_prefill else "decode", seconds=seconds)
        self.last_step["tokens"] = sum(len(s.prompt_ids) for s in seqs) if is_prefill else len(seqs)
        self._stats.steps += 1
        if is_prefill:
            self._stats.prefill_tokens += sum(len(s.prompt_ids) for s in seqs)
            self._stats.prefill_time_s += seconds
        else:
            self._stats.decode_tokens += len(seqs)
            self._stats.decode_time_s += seconds

    def abort(self, seq_id: int) -> None:
        """Drop a request now; the next step() reports it once with finish_reason 'abort'."""
        if self.scheduler.abort(seq_id):
            self._aborted.append(StepOutput(seq_id, None, True, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    @property
    def stats(self) -> EngineStats:
        counters = self.strategy.counters()
        fields = {k: v for k, v in counters.items() if hasattr(self._stats, k)}
        return EngineStats(**{**self._stats.__dict__, **fields})

    def close(self) -> None:
        self.strategy.close()
