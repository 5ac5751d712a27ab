"""MoE strategies, chosen in ONE place: `build_strategy`.

The seam for later strategies (hybrid, auto; issue 3): add the module, add its name to
`ft.engine.config.STRATEGIES`, and add one branch here.
"""

from __future__ import annotations

from ft.engine.config import EngineConfig
from ft.engine.experts.store import HostExpertStore
from ft.engine.strategies.base import MoeStrategy
from ft.errors import FtError


def build_strategy(
    config: EngineConfig, store: HostExpertStore, cache_size: int | None = None
) -> MoeStrategy:
    """The strategy object for this engine; `cache_size` is the resolved number of slots."""
    if config.moe_strategy == "resident":
        from ft.engine.strategies.resident import ResidentStrategy

        return ResidentStrategy(store, config.device)
    if config.moe_strategy == "offload":
        from ft.engine.strategies.offload import OffloadStrategy

        if cache_size is None:
            raise FtError("offload needs a cache size (resolve it with ft.engine.memory)")
        return OffloadStrategy(store, config.device, cache_size)
    raise FtError(f"moe_strategy {config.moe_strategy!r} is not available in this build")
