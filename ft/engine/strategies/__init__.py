"""MoE strategies, and the one place that decides what the engine does for a configuration:
`decode_plan` (which strategy class, how decode is captured, how far and how much it prefetches).

`auto` never gets here: ft.engine.resolve turns it into one of the others at startup. The
decode step each plan runs: docs/decode-step.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ft import settings
from ft.engine.config import EngineConfig
from ft.engine.experts.store import HostExpertStore
from ft.engine.strategies.base import MoeStrategy
from ft.errors import FtError

# how decode runs on CUDA: "step" one graph per step (no host in it), "follow" one graph per
# step that the host follows (device gates), "stretch" a graph per stretch between host stops,
# "eager" no graphs (the CPU, FT_CUDA_GRAPHS=0)
GRAPH_MODES = ("step", "follow", "stretch", "eager")


@dataclass(frozen=True)
class DecodePlan:
    strategy: type[MoeStrategy]
    graphs: str  # one of GRAPH_MODES
    prefetch_depths: tuple[int, int]  # MoE layers ahead guessed (at batch 1, above); (0, 0): off
    prefetch_window: int  # guessed experts queued for copy at once (0: no bound)


def decode_plan(config: EngineConfig) -> DecodePlan:
    """What the engine does for `config` (resolved: not `auto`)."""
    kind = _strategy_class(config)
    graphs = "eager"
    if config.device == "cuda" and settings.cuda_graphs():
        if kind.graph_safe:
            graphs = "step"
        elif kind.host_follows:
            graphs = "follow"
        elif kind.host_stop:
            graphs = "stretch"
    return DecodePlan(kind, graphs, config.prefetch_depths, config.prefetch_window)


def _strategy_class(config: EngineConfig) -> type[MoeStrategy]:
    if config.moe_strategy == "resident":
        from ft.engine.strategies.resident import ResidentStrategy

        return ResidentStrategy
    if config.moe_strategy == "offload":
        if config.gates:
            from ft.engine.strategies.gated import GatedOffloadStrategy

            return GatedOffloadStrategy
        from ft.engine.strategies.offload import OffloadStrategy

        return OffloadStrategy
    if config.moe_strategy == "hybrid":
        from ft.engine.strategies.hybrid import GatedHybridStrategy, HybridStrategy

        return GatedHybridStrategy if config.gates else HybridStrategy
    raise FtError(f"moe_strategy {config.moe_strategy!r} is not available in this build")


def build_strategy(
    config: EngineConfig,
    store: HostExpertStore,
    cache_size: int | None = None,
    top_k: int = 0,
    max_fetch: float | None = None,
) -> MoeStrategy:
    """The strategy object of `decode_plan(config)`; `cache_size` is the resolved number of
    slots, `max_fetch` hybrid's resolved fraction of misses fetched (`top_k`: its log line)."""
    plan = decode_plan(config)
    if config.moe_strategy == "resident":
        return plan.strategy(store, config.device)
    if cache_size is None:
        raise FtError(
            f"{config.moe_strategy} needs a cache size (resolve it with ft.engine.memory)"
        )
    if config.moe_strategy == "offload":
        return plan.strategy(
            store, config.device, cache_size, plan.prefetch_depths, plan.prefetch_window
        )
    from ft.engine.strategies.hybrid import build_hybrid

    if max_fetch is None:
        raise FtError("hybrid needs a fetch fraction (ft.engine.resolve)")
    return build_hybrid(config, plan, store, cache_size, top_k, max_fetch)
