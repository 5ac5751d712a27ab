"""CUDA graphs for the decode step (on by default on CUDA; FT_CUDA_GRAPHS=0 turns them off).

The step is cut at each MoE layer where the strategy needs the host: resident (graph_safe) is
one graph; host stops (host_stop) a graph per stretch between cuts, the host reading each cut's
ids, fetching and launching the next (`run_step`); device gates (host_follows) one graph for
the whole step that the host follows through pinned `StopRows`, each layer waiting on the GPU
for its gate (`follow_step`). A stretch's last kernels write what the host and the next stretch
read (h, x, one top-k over the cut's and the guessed cuts' routers), with no copy after them.
Stretches read one set of buffers and write the other, so the warm-up before a capture changes
nothing; sampling stays outside the graphs. The whole picture: docs/decode-step.md.

Legend: B = sequences, D = hidden, K = experts per token, V = vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.engine.experts.cache import device_view
from ft.engine.model.attention import Batch, Span
from ft.engine.model.decoder import route
from ft.engine.model.fused import rms_norm
from ft.errors import FtError

KV_BUCKET = 256  # keys per bucket: one graph serves every length up to its bucket


def decode_logits(model, tokens, positions, slots, kv_len: int) -> torch.Tensor:
    """One eager decode step (one new token per sequence) over `kv_len` keys -> logits [B, V]."""
    batch = _decode_batch(tokens, positions, slots, kv_len)
    h, delta = F.embedding(tokens, model.embed), None
    for layer in model.layers:
        h, delta = layer.forward(h, delta, batch)
    return model.logits(h, delta)


def kv_bucket(longest: int, max_len: int, bucket: int = KV_BUCKET) -> int:
    return min(-(-longest // bucket) * bucket, max_len)


def _decode_batch(tokens, positions, slots, kv_len: int) -> Batch:
    spans = [Span(0, 0, 1)] * tokens.shape[0]  # only their lengths are read: all decode
    return Batch(tokens, positions, spans, slots, kv_len=kv_len)


@dataclass
class Handoff:
    """What a stretch leaves for the next one at a cut: [B_max, ...] static buffers, written by
    the stretch's last kernels themselves (the norm after attention, the routers' top-k)."""

    h: torch.Tensor  # [B, D] residual stream after the cut layer's attention
    x: torch.Tensor  # [B, D] that layer's MoE input
    weights: torch.Tensor  # [B, K] its routing weights
    # [B, (1 + depth) K] what the host reads: the routed ids, then the guesses of the next
    # `depth` cuts (prefetch_depth)
    stop: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, cfg, dtype, device, depth: int = 1) -> Handoff:
        act = lambda: torch.zeros(max_batch, cfg.hidden_size, dtype=dtype, device=device)  # noqa: E731
        weights = torch.zeros(max_batch, cfg.top_k, dtype=dtype, device=device)
        stop = torch.zeros(max_batch, (1 + depth) * cfg.top_k, dtype=torch.long, device=device)
        return cls(act(), act(), weights, stop)

    @property
    def ids(self) -> torch.Tensor:
        """[B, K] the cut's routed experts: the stop's first columns (a strided view)."""
        return self.stop[:, : self.weights.shape[1]]

    def rows(self, b: int) -> Handoff:
        """The first b sequences' rows (views: the same static buffers)."""
        return Handoff(self.h[:b], self.x[:b], self.weights[:b], self.stop[:b])


def cut_layers(model, strategy) -> list[int]:
    """The MoE layers where decode stops for the host (or where the host follows it): none for
    graph_safe strategies."""
    cut = strategy.host_stop or strategy.host_follows
    return [layer.index for layer in model.layers if layer.is_moe] if cut else []


class StopRows:
    """Decode on gates: each cut's stop columns (routed ids, then guesses) as the step's graph
    writes them, [cuts, B, (1 + depth) K] int64 in pinned host memory that the router's top-k
    writes through its device address and the host polls; -1 until written, reset once read.
    (Host stops read their ids back with a sync instead: polling these rows was level with it
    at batch 1 and 4.)"""

    TIMEOUT_S = 60.0  # a step whose rows never come has failed on the device

    def __init__(self, cuts: int, max_batch: int, width: int, device):
        cuda = torch.device(device).type == "cuda"
        self.host = torch.full((cuts, max_batch, width), -1, dtype=torch.long, pin_memory=cuda)
        self.device = device_view(self.host, torch.device(device)) if cuda else self.host
        self._items = self.host.numpy()  # the host's reads and writes: no torch op per poll
        self.width = width

    def wait(self, k: int, b: int, width: int, idle=None) -> list[list[int]]:
        """Cut k's rows for b sequences, their first `width` columns (what the stretch writes:
        near the last cut there are fewer guesses), once the graph has written them; then
        reset. `idle()`, if given, is called at each poll until they come."""
        rows = self._items[k, :b, :width]
        deadline = None
        while (rows < 0).any():  # the engine's thread spins here while the GPU computes
            if idle is not None:
                idle()
            now = time.monotonic()
            deadline = deadline or now + self.TIMEOUT_S
            if now > deadline:
                raise FtError(
                    f"decode: the routing of MoE cut {k} did not arrive in {self.TIMEOUT_S:g} s"
                )
        got = rows.tolist()
        self._items[k, :b].fill(-1)  # the whole rows: the stretch copies all its columns
        return got

    def ready(self, k: int, b: int) -> bool:
        """Whether cut k's routed ids are written (the GPU has routed that cut already)."""
        return bool((self._items[k, :b, 0] >= 0).all())

    def clear(self) -> None:
        self._items.fill(-1)


def columns(rows: list[list[int]], j: int, top_k: int) -> list[list[int]]:
    """The j-th block of top_k columns of each row read from a stop (j = 0: the routed ids,
    j > 0: the j-th guessed cut's ids)."""
    return [row[j * top_k : (j + 1) * top_k] for row in rows]


def next_token_cuts(cuts: list[int], depth: int) -> list[int]:
    """The first cuts of the next step, whose experts the step's end guesses (as many as a cut's
    stop row holds: 1 + depth)."""
    return cuts[: 1 + depth]


def guess_next_token(model, cuts: list[int], logits, dst: Handoff, rows) -> None:
    """After the logits [B, V]: the routers of the next step's first cuts applied to the
    embedding of each sequence's argmax token, normed as the first cut's MoE input; the ids
    written to `rows` (pinned, [B, >= cuts K]) for the host to copy in while the GPU samples and
    starts the next step (its layer 0 has no earlier router in the step to guess it). A guess:
    sampling may pick another token, and attention is left out."""
    b, first = logits.shape[0], model.layers[cuts[0]]
    embedded = F.embedding(logits.argmax(dim=-1), model.embed)
    x = rms_norm(embedded, first.w["ln2"], model.cfg.rms_norm_eps)
    router = model.routers_of(0, len(next_token_cuts(cuts, first.moe.depth_at(b))))
    route(model.cfg, router, x, first.kernel, out=(dst.stop[:b], dst.weights[:b]), mirror=rows)


def guessed_cuts(cuts: list[int], k: int, depth: int) -> list[int]:
    """The cuts whose experts the stretch ending at cut k guesses, and the stop at cut k
    prefetches, nearest first: up to `depth` of them."""
    return cuts[k + 1 : k + 1 + depth]


def run_stretch(model, cuts: list[int], k: int, src: Handoff, dst: Handoff, inputs, stop=None):
    """Stretch k of the step: finish cut k-1's experts, run to cut k's routing (-> dst's first
    B rows, returned; the stop columns into `stop` if given), or on the last stretch to the
    logits (returned; with `stop`, also the next token's guessed ids into it)."""
    tokens, positions, slots, kv_len = inputs
    batch, b = _decode_batch(tokens, positions, slots, kv_len), tokens.shape[0]
    if k == 0:
        h, delta, first = F.embedding(tokens, model.embed), None, 0
    else:
        cut = model.layers[cuts[k - 1]]
        delta = cut.moe.compute(cut.index, src.x[:b], src.ids[:b], src.weights[:b])
        h, first = src.h[:b], cut.index + 1
    last = cuts[k] if k < len(cuts) else len(model.layers)
    for layer in model.layers[first:last]:
        h, delta = layer.forward(h, delta, batch)
    if k == len(cuts):
        logits = model.logits(h, delta)
        if stop is not None:  # the host follows and copies the next token's guesses in
            guess_next_token(model, cuts, logits, dst, stop)
        return logits
    layer = model.layers[last]
    h, x = layer.attend(h, delta, batch, out=(dst.h[:b], dst.x[:b]))
    # the cut's routing and the next cuts' guesses from the same x: one GEMM, one top-k
    ahead = guessed_cuts(cuts, k, layer.moe.depth_at(b))
    router = model.routers_of(k, 1 + len(ahead))
    # decode on gates (`stop`): the top-k also writes the ids and guesses where the host polls
    route(model.cfg, router, x, layer.kernel, out=(dst.stop[:b], dst.weights[:b]), mirror=stop)
    return dst.rows(b)


def run_step(strategy, cuts: list[int], launch) -> torch.Tensor:
    """The host's loop over one decode step's stretches; `launch(k)` queues stretch k and returns
    its output (the Handoff rows it writes, or on the last stretch the logits).

    At cut k the host reads the rows (the step's one sync per cut), makes the cut's experts ready
    (`prepare`: fetch the misses, write their slots in the table) and launches the next stretch;
    only then does it start copying the later cuts' guessed misses (`prefetch`), so the GPU is not
    kept waiting for those calls and the copies overlap the stretch just queued. That stretch reads
    the cut's experts only, which a prefetch never evicts.
    """
    guesses = []
    for k in range(len(cuts) + 1):
        out = launch(k)
        for guess in guesses:
            strategy.prefetch(*guess)
        if k < len(cuts):
            guesses = stop(strategy, cuts, k, out)
    return out


def stop(strategy, cuts: list[int], k: int, handoff: Handoff) -> list[tuple]:
    """The host's part at cut k before the next stretch, given the Handoff rows the stretch
    before it wrote -> the prefetches to start once the next stretch is queued, nearest cut
    first: (layer, ids [B][K], keep_layer) each."""
    rows = handoff.stop.tolist()  # [B][(1 + deepest depth) K]: the cut's one host sync
    top_k = len(rows[0]) // (1 + strategy.prefetch_depth)
    strategy.prepare(cuts[k], columns(rows, 0, top_k), handoff.x, handoff.weights)
    ahead = guessed_cuts(cuts, k, strategy.depth_at(len(rows)))
    return [(cut, columns(rows, j + 1, top_k), cuts[k]) for j, cut in enumerate(ahead)]


def follow_step(
    strategy, cuts: list[int], rows: StopRows, b: int, launch, handoffs=None
) -> torch.Tensor:
    """The host's side of a decode step it follows (device gates): `launch()` queues the whole
    step (each cut waiting for its `follow`, the gates shut first by `begin_step`) and returns
    its logits; then, cut by cut as the GPU publishes them, the host hands the routed ids and
    the guesses of the next cuts to `strategy.follow`, which copies experts in for this cut,
    later layers and tokens.
    A guess for a cut the GPU has routed already is dropped: it comes too late to help.
    handoffs: the step's two Handoff buffers; cut k's input is in the one stretch k writes
    (hybrid's CPU experts read it)."""
    strategy.begin_step()
    out = launch()
    top_k, depth = rows.width // (1 + strategy.prefetch_depth), strategy.depth_at(b)
    for k, cut in enumerate(cuts):
        ahead = guessed_cuts(cuts, k, depth)
        # [B][(1 + guessed cuts) K]; meanwhile the strategy keeps the copy engine fed (gates)
        got = rows.wait(k, b, (1 + len(ahead)) * top_k, strategy.top_up)
        guesses = [
            (later, columns(got, j + 1, top_k))
            for j, later in enumerate(ahead)
            if not rows.ready(k + 1 + j, b)
        ]
        inputs = handoffs[(k + 1) % 2].rows(b) if handoffs is not None else None
        strategy.follow(cut, columns(got, 0, top_k), guesses, inputs)
    if strategy.host_follows:  # the step's last rows: the next token's first cuts
        ahead = next_token_cuts(cuts, depth)
        got = rows.wait(len(cuts), b, len(ahead) * top_k, strategy.top_up)
        strategy.guess_next_token([(cut, columns(got, j, top_k)) for j, cut in enumerate(ahead)])
    return out


class DecodeGraphs:
    """Captured decode stretches keyed by (B, kv bucket), replayed on static buffers."""

    def __init__(self, model, strategy, max_batch: int, max_len: int, device):
        self.model, self.strategy, self.max_len = model, strategy, max_len
        self.cuts = cut_layers(model, strategy)
        # SDPA attends over a fixed key count (the bucket); the Triton decode attention reads
        # each sequence's own length on the device, so one graph serves every length
        sdpa = any(layer.decode == "sdpa" for layer in model.layers)
        self.bucket = KV_BUCKET if sdpa else max_len
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.tokens)
        self.slots = torch.zeros_like(self.tokens)
        dtype, depth = model.embed.dtype, strategy.prefetch_depth
        self.handoffs = [
            Handoff.allocate(max_batch, model.cfg, dtype, device, depth) for _ in range(2)
        ]
        self.rows = None  # decode on gates: the cuts' stop columns, polled by the host
        if strategy.host_follows:
            width = (1 + depth) * model.cfg.top_k
            cuts = len(self.cuts) + 1  # and the next token's guesses
            self.rows = StopRows(cuts, max_batch, width, device)
        self.graphs: dict[tuple[int, int], list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self.pool = None

    def fits(self, batch_size: int) -> bool:
        return self.strategy.decode_fits(batch_size * self.model.cfg.top_k)

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        b = batch.token_ids.shape[0]
        self.tokens[:b].copy_(batch.token_ids)
        self.positions[:b].copy_(batch.positions)
        self.slots[:b].copy_(batch.slots)
        key = (b, kv_bucket(max(s.start for s in batch.spans) + 1, self.max_len, self.bucket))
        if self.rows is not None:  # gates: the whole step is one graph the host follows
            replay = lambda: self._replay(key)  # noqa: E731
            out = follow_step(self.strategy, self.cuts, self.rows, b, replay, self.handoffs)
        else:
            out = run_step(self.strategy, self.cuts, lambda k: self._replay(key, k))
        return out.clone()  # graphs share one memory pool: the next replay may reuse `out`

    def _replay(self, key: tuple[int, int], k: int | None = None) -> torch.Tensor:
        """Replay stretch k, or with k None the whole step as one graph (gates), captured
        on first use -> its output (the Handoff rows it writes, or the logits)."""
        graphs = self.graphs.setdefault(key, [])
        if k is None:
            if not graphs:
                graphs.append(self._capture(range(len(self.cuts) + 1), *key))
            k = 0
        elif k == len(graphs):  # first step with this key: capture as we go
            graphs.append(self._capture([k], *key))
        graph, out = graphs[k]
        graph.replay()
        return out

    def _run(self, k: int, b: int, kv_len: int) -> torch.Tensor:
        src, dst = self.handoffs[k % 2], self.handoffs[(k + 1) % 2]
        inputs = (self.tokens[:b], self.positions[:b], self.slots[:b], kv_len)
        rows = self.rows.device if self.rows is not None else None
        stop = rows[k, :b] if rows is not None and k < rows.shape[0] else None
        return run_stretch(self.model, self.cuts, k, src, dst, inputs, stop)

    def _capture(self, stretches, b: int, kv_len: int):
        """One graph of these stretches, in order -> (graph, the last one's output)."""
        saved = [t.clone() for t in self.strategy.device_counters()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: compile kernels, create handles, off the graph
            for _ in range(2):  # rewrites this step's own K/V and handoff with the same values
                for k in stretches:
                    self._run(k, b, kv_len)
        torch.cuda.current_stream().wait_stream(side)
        for counter, value in zip(self.strategy.device_counters(), saved, strict=True):
            counter.copy_(value)  # the warm-up steps are not the user's
        if self.rows is not None:  # the warm-ups wrote the cuts' rows: not this step's to read
            torch.cuda.synchronize()
            self.rows.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for k in stretches:
                out = self._run(k, b, kv_len)
        self.pool = graph.pool()
        return graph, out
