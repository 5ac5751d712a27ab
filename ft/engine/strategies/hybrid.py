"""`hybrid`: as offload, but of each layer's cache misses only a fraction is fetched into device
slots; the rest is computed on the CPU by the pinned CPU MoE executor, from the host store,
overlapped with the fetches.

On device gates (the default on CUDA, GatedHybridStrategy) the step is offload's one graph the
host follows; a layer's CPU experts run while the GPU waits at that layer's gate, and their sum
reaches the device through a pinned row the layer's sum reads (below).

With `--no-moe-gates` (HybridStrategy), decode, per MoE layer, at offload's host stop
(`prepare`, after the router's ids reach the host):
split the misses into fetch | cpu -> submit the CPU jobs first (the pool starts at once) ->
fetch the device's experts into slots (copies on their own stream, as offload) -> wait for the
CPU's result and copy it to a device buffer. `compute` (no host sync, so graphed decode replays
it) runs the hits and fetched experts from their slots (the CPU's experts have none: skipped)
and adds that buffer. Prefill groups on the host, with the same split.

Both count, per decode layer with CPU experts, the host's time in each part of that layer's
round trip (ROUND_TRIP, RoundTrip): what `ft bench decode` reports as what a CPU layer costs.
Legend: T = tokens, D = hidden, K = experts per token.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ft import settings
from ft.engine.cpu.compute import uses_kernels
from ft.engine.cpu.pool import (
    CpuMoeExecutor,
    CpuMoeHandle,
    log_ready,
    lower_torch_threads,
)
from ft.engine.experts.cache import device_view
from ft.engine.experts.dispatch import ExpertGroup, group_by_expert
from ft.engine.experts.grouped import (
    CPU_SHARE,
    MAX_DEVICE_PAIRS,
    CpuShare,
)
from ft.engine.strategies.gated import GatedOffloadStrategy, flat_guesses
from ft.engine.strategies.offload import OffloadStrategy

# The CPU wins only at a few tokens per expert (decode); an expert with more tokens than this is
# always fetched, whatever the fraction (the seed's executor line says max_tokens=4).
CPU_MAX_TOKENS = 4


def split_misses(
    misses: Sequence[int],
    token_counts: Sequence[int],
    max_fetch: float,
    prefill_threshold: int = CPU_MAX_TOKENS,
) -> tuple[list[int], list[int]]:
    """(fetch, cpu): which missed experts go to device cache slots, which to the CPU pool.

    round(max_fetch x misses) experts are fetched (half up), those with the most tokens first
    (ties: in the given order). Experts with more than `prefill_threshold` tokens are always
    fetched and count toward that number. Both lists keep the given order.
    """
    if len(misses) != len(token_counts):
        raise ValueError("split_misses: one token count per missed expert")
    want = math.floor(max_fetch * len(misses) + 0.5)
    by_tokens = sorted(range(len(misses)), key=lambda i: -token_counts[i])  # stable
    forced = [i for i in by_tokens if token_counts[i] > prefill_threshold]
    rest = [i for i in by_tokens if token_counts[i] <= prefill_threshold]
    chosen = set(forced + rest[: max(0, want - len(forced))])
    fetch = [e for i, e in enumerate(misses) if i in chosen]
    cpu = [e for i, e in enumerate(misses) if i not in chosen]
    return fetch, cpu


# The parts of a decode layer's round trip to the CPU pool, in the order the host runs them: its
# input back to the host, the pool's call published, the device side's work queued while the
# pool computes (the cache's bookkeeping, the other misses' copies), the wait for the pool after
# that, and its sum handed to the device (on gates: the gate opened). While the host runs them
# the layer's device work waits (on gates at the layer's gate), so their sum bounds what a CPU
# expert can save over its copy.
ROUND_TRIP = ("inputs", "submit", "cache", "wait", "share")


class RoundTrip:
    """The host's time in each part of ROUND_TRIP, summed over the CPU layers so far."""

    def __init__(self) -> None:
        self.layers = 0
        self.seconds = dict.fromkeys(ROUND_TRIP, 0.0)

    def add(self, stamps: Sequence[float]) -> None:
        """One layer's perf_counter stamps: as it starts, then as each part ends."""
        if len(stamps) != len(ROUND_TRIP) + 1:
            raise ValueError(f"RoundTrip.add: {len(ROUND_TRIP) + 1} stamps, got {len(stamps)}")
        self.layers += 1
        for part, start, end in zip(ROUND_TRIP, stamps[:-1], stamps[1:], strict=True):
            self.seconds[part] += end - start

    def counters(self) -> dict[str, int]:
        """cpu_layers and cpu_<part>_us: totals, so a step's are the difference (runner)."""
        parts = {f"cpu_{part}_us": round(s * 1e6) for part, s in self.seconds.items()}
        return {"cpu_layers": self.layers, **parts}


class CpuPoolSide:
    """What both hybrids share: the pinned pool, the split of a layer's misses between PCIe
    and the CPU, the CPU's jobs, and the counters and cleanup of the pool."""

    def _init_cpu(self, pool: CpuMoeExecutor, max_fetch: float, cpu_max_tokens: int,
                  torch_threads_before: int | None) -> None:  # fmt: skip
        self.pool = pool
        self.max_fetch = max_fetch
        self.cpu_max_tokens = cpu_max_tokens
        self.experts_cpu_total = 0  # misses handed to the CPU (in the pool or inline)
        self.cpu_threads: set[str] = set()  # names of the threads that ran the CPU's experts
        self.round_trip = RoundTrip()  # decode layers with CPU experts: the host's time in each
        self._torch_threads_before = torch_threads_before

    def _forward_grouped(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        """Prefill (or a layer past the device work list): grouped on the host; the CPU's
        experts start first, the device's are fetched and computed as offload's."""
        groups = group_by_expert(topk_ids, topk_weights, self.store.num_experts)
        self.expert_uses += len(groups)
        on_device, on_cpu = self._split(layer, groups)
        handle = self._submit_cpu(layer, x, topk_ids, topk_weights, on_cpu)  # before device work
        out = torch.zeros_like(x)  # [T, D]
        self.run_groups(layer, x, on_device, out)  # hits and fetches, exactly as offload
        if handle is not None:
            out += handle.wait().to(out.device, out.dtype)
            self.cpu_threads |= handle.ran_on
        return out

    def _split(self, layer: int, groups: list[ExpertGroup]) -> tuple[list[ExpertGroup], list[int]]:
        """-> (groups for the device: hits + fetched misses, experts for the CPU)."""
        cpu = self._misses_for_cpu(layer, {g.expert: g.rows.numel() for g in groups})
        hits = [g for g in groups if self.cache.slot_of(layer, g.expert) is not None]
        misses = [g for g in groups if self.cache.slot_of(layer, g.expert) is None]
        on_cpu = set(cpu)
        return hits + [g for g in misses if g.expert not in on_cpu], cpu

    def _route(self, layer: int, topk_ids: list[list[int]]) -> tuple[list[int], list[int]]:
        """A decode layer's routed experts (sorted; counted in expert_uses) and the misses
        among them that split_misses leaves to the CPU."""
        tokens = Counter(e for row in topk_ids for e in row)  # expert -> tokens routed to it
        routed = sorted(tokens)
        self.expert_uses += len(routed)
        return routed, self._misses_for_cpu(layer, {e: tokens[e] for e in routed})

    def _misses_for_cpu(self, layer: int, tokens: dict[int, int]) -> list[int]:
        """Of a layer's routed experts (expert -> tokens routed to it, in order), the cache
        misses that split_misses leaves to the CPU; the other misses are fetched."""
        misses = [e for e in tokens if self.cache.slot_of(layer, e) is None]
        counts = [tokens[e] for e in misses]
        return split_misses(misses, counts, self.max_fetch, self.cpu_max_tokens)[1]

    def _submit_cpu(self, layer, x, topk_ids, topk_weights, experts) -> CpuMoeHandle | None:
        if not experts:
            return None
        x_host = x.to("cpu")  # [T, D]: the layer's one copy of activations to the host
        ids, weights = topk_ids.to("cpu"), topk_weights.to("cpu")  # [T, K] routing
        self.experts_cpu_total += len(experts)  # each is routed a token (_route, _split)
        bank = self.store.banks[layer]
        return self.pool.submit_routed(x_host, bank, self.fmt, ids, weights, experts)

    def close(self) -> None:
        self.pool.close()
        if self._torch_threads_before is not None:  # give torch its cores back
            torch.set_num_threads(self._torch_threads_before)
            self._torch_threads_before = None


class HybridStrategy(CpuPoolSide, OffloadStrategy):
    name = "hybrid"

    def __init__(
        self,
        store,
        device,
        num_slots: int,
        pool: CpuMoeExecutor,
        max_fetch: float,
        cpu_max_tokens: int = CPU_MAX_TOKENS,
        torch_threads_before: int | None = None,  # restored on close()
        prefetch_depth: int | tuple[int, int] = 2,
        prefetch_window: int = 0,
    ):
        super().__init__(store, device, num_slots, prefetch_depth, prefetch_window)
        self._init_cpu(pool, max_fetch, cpu_max_tokens, torch_threads_before)
        # the CPU's share of the layer at the last stop: [T, D] float32, read by `compute`
        shape, cuda = (MAX_DEVICE_PAIRS, store.hidden_size), torch.device(device).type == "cuda"
        self._cpu_share = torch.zeros(shape, dtype=torch.float32, device=device)
        self._cpu_staging = torch.zeros(shape, dtype=torch.float32, pin_memory=cuda)
        self._share_rows = 0  # rows of _cpu_share the last hand-over wrote (the rest are zero)

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if self.decode_fits(topk_ids.numel()):  # offload's: prepare (one host sync), compute
            return super().forward(layer, x, topk_ids, topk_weights)
        return self._forward_grouped(layer, x, topk_ids, topk_weights)

    def prepare(self, layer: int, topk_ids: list[list[int]], x, topk_weights) -> None:
        routed, cpu = self._route(layer, topk_ids)  # ensure fetches the other misses
        if not cpu:
            self.cache.ensure(layer, routed)
            self._clear_share()
            return
        stamps = [time.perf_counter()]  # ROUND_TRIP's parts, each stamped as it ends
        x_host, weights = x.to("cpu"), topk_weights.to("cpu")  # the ids are on the host already
        stamps.append(time.perf_counter())
        handle = self._submit_cpu(layer, x_host, torch.tensor(topk_ids), weights, cpu)
        stamps.append(time.perf_counter())  # the pool starts before the copies are queued
        on_cpu = set(cpu)
        # hits + fetches; the CPU's experts are in no slot: -1 in the table, compute skips them
        self.cache.ensure(layer, [e for e in routed if e not in on_cpu])
        stamps.append(time.perf_counter())
        result = handle.wait()  # while the fetches cross PCIe
        self.cpu_threads |= handle.ran_on
        stamps.append(time.perf_counter())
        self._hand_over(result)
        stamps.append(time.perf_counter())
        self.round_trip.add(stamps)

    def _clear_share(self) -> None:
        """Zeros where `compute` adds the CPU's share: a launch only where the last stop left
        one."""
        if self._share_rows:
            self._cpu_share[: self._share_rows].zero_()
            self._share_rows = 0

    def _hand_over(self, result: torch.Tensor) -> None:
        """The CPU's share [T, D] into the device buffer `compute` adds."""
        tokens = result.shape[0]
        share = self._cpu_share[:tokens]
        self._share_rows = max(self._share_rows, tokens)
        if share.device.type == "cpu":
            share.copy_(result)
            return
        # pinned staging, so the copy does not block: the host rewrites it only at the next
        # stop, after a sync on work queued behind this copy
        staging = self._cpu_staging[:tokens]
        staging.copy_(result)
        share.copy_(staging, non_blocking=True)

    def compute(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        share = self._cpu_share[: x.shape[0]]  # written at this layer's stop
        return (self.device_share(layer, x, topk_ids, topk_weights) + share).to(x.dtype)

    def counters(self) -> dict[str, int]:
        c, pool = self.cache, self.pool.stats
        return dict(
            cache_hits=c.hits, cache_misses=c.misses + self.experts_cpu_total,
            experts_fetched=c.loads, bytes_fetched=c.bytes_fetched,
            experts_to_cpu=self.experts_cpu_total, experts_cpu=pool.experts_in_pool,
            experts_cpu_inline=pool.experts_inline, expert_uses=self.expert_uses,
            experts_prefetched=c.prefetched, prefetch_hits=c.prefetch_hits,
            **self.round_trip.counters(),
        )  # fmt: skip


class GatedHybridStrategy(CpuPoolSide, GatedOffloadStrategy):
    """`hybrid` on device gates (its default on CUDA): hybrid's split of the misses on offload's
    gates. The step is one graph the host follows (ft.engine.strategies.gated); at a layer
    with misses the host copies the fetched ones as offload does, and for the CPU's ones copies
    the layer's input and weights back (on a side stream: the GPU waits at the gate, so they
    stay put), runs them on the pool, writes their sum [T, D] into the layer's pinned row of
    `share`, and only then opens the gate with CPU_SHARE. The plan skips the experts the table
    marks ON_CPU and the sum adds the row; a gate that never opens (a stalled host) has the
    marked experts read in place instead, so the result stays exact. A layer without a CPU
    expert goes as offload's: kept, or through its gate."""

    def __init__(
        self, store, device, num_slots: int, pool: CpuMoeExecutor, max_fetch: float,
        cpu_max_tokens: int = CPU_MAX_TOKENS, torch_threads_before: int | None = None,
        prefetch_depth: int | tuple[int, int] = 2, prefetch_window: int = 0,
    ):  # fmt: skip
        super().__init__(store, device, num_slots, prefetch_depth, prefetch_window)
        self._init_cpu(pool, max_fetch, cpu_max_tokens, torch_threads_before)
        cuda = torch.device(device).type == "cuda"
        layers, shape = len(store.banks), (MAX_DEVICE_PAIRS, store.hidden_size)
        # per layer: the CPU's sum of its experts, written by the host before it opens the gate
        self._share = torch.zeros(layers, *shape, dtype=torch.float32, pin_memory=cuda)
        self.share_rows = device_view(self._share, torch.device(device)) if cuda else self._share
        self._shared = torch.zeros(layers, dtype=torch.int32, device=device)  # set by the plans
        self._d2h = torch.cuda.Stream(device) if cuda else None  # the layer's input, back
        self._host_buffers: dict[tuple, torch.Tensor] = {}  # pinned: where it lands

    def cpu_share(self, layer: int) -> CpuShare:
        """The layer's pinned share row and the flag its plan sets for the sum (device_share:
        the plan skips the experts marked ON_CPU where the gate opened with CPU_SHARE)."""
        return CpuShare(self.share_rows[layer], self._shared[layer : layer + 1])

    def follow(self, layer, topk_ids, guesses, inputs=None) -> None:
        """As offload's on gates; a layer with misses for the CPU needs `inputs` (its x and
        weights, [T, D] and [T, K], where the device holds them until the gate opens)."""
        experts, cpu = self._route(layer, topk_ids)
        if not cpu:
            self.cache.follow(layer, experts, flat_guesses(guesses))
            return
        # the GPU waits at the gate throughout; ROUND_TRIP's parts, each stamped as it ends
        stamps = [time.perf_counter()]
        x, weights = self._inputs_on_host(inputs, len(topk_ids))
        stamps.append(time.perf_counter())
        handle = self._submit_cpu(layer, x, torch.tensor(topk_ids), weights, cpu)
        stamps.append(time.perf_counter())  # the pool starts before the copies and guesses
        self.cache.follow(layer, experts, flat_guesses(guesses), on_cpu=cpu)
        stamps.append(time.perf_counter())
        result = handle.wait()
        self.cpu_threads |= handle.ran_on
        stamps.append(time.perf_counter())
        self._share[layer, : result.shape[0]].copy_(result)
        self.cache.open(layer, CPU_SHARE)
        stamps.append(time.perf_counter())
        self.round_trip.add(stamps)

    def _inputs_on_host(self, inputs, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cut's x [T, D] and weights [T, K] on the host. On CUDA on a side stream with no
        wait on the step's: they were written before the routing the host has read, and the
        step, waiting at this layer's gate, cannot overwrite them."""
        if inputs is None:
            raise RuntimeError("hybrid on gates: a layer with CPU experts needs its inputs")
        x, weights = inputs.x[:tokens], inputs.weights[:tokens]
        if self._d2h is None:
            return x, weights
        host = [self._staging(k, t) for k, t in (("x", x), ("weights", weights))]
        with torch.cuda.stream(self._d2h):
            for dst, src in zip(host, (x, weights), strict=True):
                dst.copy_(src, non_blocking=True)
        self._d2h.synchronize()
        return host[0], host[1]

    def _staging(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer shaped as `like`, made once per shape (a copy into pinned
        memory is one DMA; pageable memory would be staged by the driver)."""
        key = (name, tuple(like.shape), like.dtype)
        buf = self._host_buffers.get(key)
        if buf is None:
            buf = self._host_buffers[key] = torch.empty(like.shape, dtype=like.dtype,
                                                        pin_memory=True)  # fmt: skip
        return buf

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        if not self.decode_fits(topk_ids.numel()):  # prefill: grouped, as host-stop hybrid's
            return self._forward_grouped(layer, x, topk_ids, topk_weights)
        # eager decode: the host follows first (a sync), then the layer reads its share
        self.follow(layer, topk_ids.tolist(), [], Inputs(x, topk_weights))
        return self.compute(layer, x, topk_ids, topk_weights)

    def counters(self) -> dict[str, int]:
        counts, pool = GatedOffloadStrategy.counters(self), self.pool.stats
        counts.update(experts_to_cpu=self.experts_cpu_total, experts_cpu=pool.experts_in_pool,
                      experts_cpu_inline=pool.experts_inline)  # fmt: skip
        counts.update(self.round_trip.counters())
        return counts


@dataclass(frozen=True)
class Inputs:
    """A layer's MoE input and routing weights, where they are (eager decode's)."""

    x: torch.Tensor
    weights: torch.Tensor


def build_hybrid(config, plan, store, cache_size: int, top_k: int, max_fetch: float):
    """Start the pinned pool, lower torch's threads, log both lines (docs/engine.md), and
    build the plan's hybrid class on it."""
    compute = settings.cpu_moe_compute()
    if uses_kernels(compute, store.format, store.parts["w13"].dtype):  # the pool's own choice
        from ft.engine.cpu import kernels as cpu_kernels  # numba: imported where it is used

        cpu_kernels.warm_up()  # the pool's kernels compiled (or loaded) now, not in a decode step
    pool = CpuMoeExecutor(
        threads=config.cpu_moe_threads, force_inline=config.cpu_moe_inline, compute=compute
    )
    before, _ = lower_torch_threads(pool.threads)
    log_ready(
        pool, fmt=config.expert_format, hidden=store.hidden_size,
        intermediate=store.intermediate_size, experts=store.num_experts,
        layers=len(store.moe_layers), top_k=top_k,
    )  # fmt: skip
    return plan.strategy(
        store, config.device, cache_size, pool, max_fetch, torch_threads_before=before,
        prefetch_depth=plan.prefetch_depths, prefetch_window=plan.prefetch_window,
    )  # fmt: skip
