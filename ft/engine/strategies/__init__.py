"""MoE strategies, chosen in ONE place: `build_strategy`.

`auto` never gets here: ft.engine.resolve turns it into one of the others at startup.
"""

from __future__ import annotations

from ft.engine.config import EngineConfig
from ft.engine.experts.store import HostExpertStore
from ft.engine.strategies.base import MoeStrategy
from ft.errors import FtError


def build_strategy(
    config: EngineConfig,
    store: HostExpertStore,
    cache_size: int | None = None,
    top_k: int = 0,
    max_fetch: float | None = None,
) -> MoeStrategy:
    """The strategy object for this engine; `cache_size` is the resolved number of slots,
    `max_fetch` hybrid's resolved fraction of misses fetched (`top_k` is for its log line)."""
    if config.moe_strategy == "resident":
        from ft.engine.strategies.resident import ResidentStrategy

        return ResidentStrategy(store, config.device)
    if config.moe_strategy == "offload":
        from ft.engine.strategies.offload import OffloadStrategy

        if cache_size is None:
            raise FtError("offload needs a cache size (resolve it with ft.engine.memory)")
        kind = OffloadStrategy
        if config.gates:
            from ft.engine.strategies.gated import GatedOffloadStrategy as kind
        return kind(
            store, config.device, cache_size, config.prefetch_depths, config.prefetch_window
        )
    if config.moe_strategy == "hybrid":
        from ft.engine.strategies.hybrid import build_hybrid

        if cache_size is None or max_fetch is None:
            raise FtError("hybrid needs a cache size and a fetch fraction (ft.engine.resolve)")
        return build_hybrid(config, store, cache_size, top_k, max_fetch)
    raise FtError(f"moe_strategy {config.moe_strategy!r} is not available in this build")
