"""What every MoE strategy is: one object the model calls for each MoE layer."""

from __future__ import annotations

import torch

from ft.engine.experts.dispatch import group_by_expert
from ft.engine.experts.grouped import (
    MAX_DEVICE_PAIRS,
    PairBlocks,
    blocks_from_groups,
    moe_pairs,
    pick_backend,
    reduce_pairs,
)
from ft.engine.experts.store import HostExpertStore


class MoeStrategy:
    """forward(layer, x [T, D], topk_ids [T, K], topk_weights [T, K]) -> [T, D]."""

    name = "base"
    graph_safe = False  # True: decode never waits for the host: the whole step is one CUDA graph
    # True: decode stops once per MoE layer for the host (`prepare`, given the router's ids),
    # and the experts' compute after it (`compute`) never waits for the host: the step is one
    # CUDA graph per stretch between stops (ft.engine.graphs).
    host_stop = False
    # True: the step is one CUDA graph, and the host follows it layer by layer (`follow`, given
    # each layer's routing as the graph writes it), each layer's experts waiting on the device
    # until the host has fetched its misses (device gates; ft.engine.graphs); the step's end
    # guesses the next token's first layers for the host (`guess_next_token`)
    host_follows = False

    def __init__(self, store: HostExpertStore, device: torch.device | str = "cpu"):
        self.store = store
        self.expert_uses = 0  # (layer, expert) pairs routed to, one per layer per forward
        self.kernel = pick_backend(device)  # "triton" | "torch": how experts are computed
        self.fmt = store.fmt  # expert format of every bank this strategy computes from

    def forward(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        groups = group_by_expert(topk_ids, topk_weights, self.store.num_experts)  # one host sync
        self.expert_uses += len(groups)
        out = torch.zeros_like(x)
        self.run_groups(layer, x, groups, out)
        return out

    def run_groups(self, layer, x, groups, out) -> None:
        raise NotImplementedError

    def decode_fits(self, pairs: int) -> bool:
        """Whether `pairs` routed (token, expert) pairs take the device work-list path."""
        return pairs <= MAX_DEVICE_PAIRS

    prefetch_depth = 0  # host_stop strategies: how many later cuts a stop prefetches guesses of

    def depth_at(self, batch: int) -> int:
        """The prefetch depth of a decode step of `batch` sequences (<= prefetch_depth, the
        deepest any batch size uses)."""
        return self.prefetch_depth

    def prepare(self, layer: int, topk_ids: list[list[int]], x, topk_weights) -> None:
        """host_stop strategies: make this layer's experts ready for `compute` (host side),
        given the router's ids on the host; x [T, D] and topk_weights [T, K] on the device."""
        raise NotImplementedError

    def prefetch(self, layer: int, topk_ids: list[list[int]], keep_layer: int) -> None:
        """prefetch_depth > 0: start fetching the experts a router guesses `layer` will
        use [T][K], without evicting any of `keep_layer`'s (its compute is queued)."""
        raise NotImplementedError

    def compute(self, layer, x, topk_ids, topk_weights) -> torch.Tensor:
        """The layer's experts on the device, no host sync: -> [T, D]."""
        raise NotImplementedError

    def begin_step(self) -> None:
        """host_follows strategies: a decode step is about to be queued (the last one is done)."""

    def follow(self, layer: int, topk_ids: list[list[int]], guesses: list[tuple], inputs=None):
        """host_follows strategies: the GPU has routed `layer` (topk_ids [T][K]) and finished
        the layers before it; guesses: (later layer, ids [T][K]) nearest first; inputs: the
        layer's MoE input and weights where the device holds them (`.x` [T, D], `.weights`
        [T, K]: a graphs.Handoff), for a strategy that computes some experts on the CPU."""
        raise NotImplementedError

    def guess_next_token(self, guesses: list[tuple]) -> None:
        """The step is done on the device; guesses: (layer, ids [T][K]) of the next token's
        first MoE layers, nearest first."""
        raise NotImplementedError

    def top_up(self) -> None:
        """host_follows strategies: called at each poll while the host waits for the GPU's
        next routing."""

    def run_blocks(self, x, bank, blocks: PairBlocks, host=None, dtype=torch.float32, share=None):
        """-> [T, D] in `dtype`: each token's pairs of the work list, computed from a bank of
        slots (or in place from a `host` bank: moe_pairs) and summed in float32, no host sync;
        plus hybrid's CPU `share` of the layer where the plan found it written."""
        y = moe_pairs(x, bank, blocks, self.kernel, self.fmt, host)  # [P, D]
        return reduce_pairs(blocks, y, x.shape[0], dtype, self.kernel, share)

    def compute_groups(self, x, bank, groups, slots: list[int], out) -> None:
        """out += every group's experts, read from bank slots `slots`: one batched compute."""
        if groups:
            out += self.run_blocks(x, bank, blocks_from_groups(groups, slots, x.device))

    def device_counters(self) -> list[torch.Tensor]:
        """Counters kept on the device (saved around CUDA-graph warm-ups)."""
        return []

    def counters(self) -> dict[str, int]:
        """Cumulative: cache_hits + cache_misses == expert_uses for every strategy."""
        raise NotImplementedError

    def close(self) -> None:
        pass
