"""CUDA graphs for the decode step (FT_CUDA_GRAPHS=1, experimental): where the MoE strategy never
waits for the host (resident), the whole step, embedding to logits, is captured once per
(batch size, KV length bucket) and replayed, so a step costs one launch instead of ~40 per
layer. Keys are attended over a bucket of KV_BUCKET positions, the padding masked; sampling
stays outside the graph.

Legend: B = sequences, V = vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.engine.attention import Batch, Span
from ft.engine.model import rms_norm

KV_BUCKET = 256  # keys per bucket: one graph serves every length up to its bucket


def decode_logits(model, tokens, positions, slots, kv_len: int) -> torch.Tensor:
    """One decode step (one new token per sequence) over `kv_len` keys -> logits [B, V] fp32."""
    spans = [Span(0, 0, 1)] * tokens.shape[0]  # only their lengths are read: all decode
    batch = Batch(tokens, positions, spans, slots, kv_len=kv_len)
    h = F.embedding(tokens, model.embed)
    for layer in model.layers:
        h = layer.forward(h, batch)
    return F.linear(rms_norm(h, model.norm, model.cfg.rms_norm_eps), model.lm_head).float()


def kv_bucket(longest: int, max_len: int) -> int:
    return min(-(-longest // KV_BUCKET) * KV_BUCKET, max_len)


class DecodeGraphs:
    """Captured decode steps keyed by (B, kv bucket), replayed on static input buffers."""

    def __init__(self, model, strategy, max_batch: int, max_len: int, device):
        self.model, self.strategy, self.max_len = model, strategy, max_len
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.tokens)
        self.slots = torch.zeros_like(self.tokens)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        b = batch.token_ids.shape[0]
        self.tokens[:b].copy_(batch.token_ids)
        self.positions[:b].copy_(batch.positions)
        self.slots[:b].copy_(batch.slots)
        key = (b, kv_bucket(max(s.start for s in batch.spans) + 1, self.max_len))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out = self.graphs[key]
        graph.replay()
        return out.clone()  # graphs share one memory pool: the next replay may reuse `out`

    def _inputs(self, b: int, kv_len: int):
        return self.tokens[:b], self.positions[:b], self.slots[:b], kv_len

    def _capture(self, b: int, kv_len: int):
        saved = [t.clone() for t in self.strategy.device_counters()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: compile kernels, create handles, off the graph
            for _ in range(2):  # rewrites this step's own K/V with the same values: harmless
                decode_logits(self.model, *self._inputs(b, kv_len))
        torch.cuda.current_stream().wait_stream(side)
        for counter, value in zip(self.strategy.device_counters(), saved, strict=True):
            counter.copy_(value)  # the warm-up steps are not the user's
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = decode_logits(self.model, *self._inputs(b, kv_len))
        self.pool = graph.pool()
        return graph, out
