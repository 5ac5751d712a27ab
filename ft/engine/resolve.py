"""Startup choices made from the box's bandwidth profile: `--moe-strategy auto` and
`--moe-hybrid-max-fetch auto`. The rules themselves live in ONE place, ft.profile.decide;
this module only applies them, and says in one log line what it chose and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ft.engine.config import EngineConfig, ModelConfig, torch_dtype
from ft.engine.formats import get_format
from ft.engine.memory import GIB, plan_kv
from ft.engine.model.attention import KVCache
from ft.engine.model.loader import CheckpointReader, is_routed_expert
from ft.errors import FtError
from ft.log import get_logger
from ft.profile import Decision, decide, default_path, fetch_log_line, load_profile

log = get_logger("ft.engine")
FALLBACK_MAX_FETCH = 0.5  # hybrid's fetch fraction when no profile says better


@dataclass(frozen=True)
class ProfileLookup:
    path: Path
    decision: Decision | None  # the rules for the checkpoint's expert format
    problem: str | None  # why there is no decision (no file, malformed, ...)


def lookup_profile(config: EngineConfig) -> ProfileLookup:
    """The profile's decision for config.expert_format; a bad profile is a reason, not a crash."""
    path = Path(config.bw_profile) if config.bw_profile else default_path()
    try:
        profile = load_profile(path)
    except FtError as exc:
        return ProfileLookup(path, None, str(exc))
    return ProfileLookup(path, decide(profile, config.expert_format), None)


def resolve_strategy(
    config: EngineConfig, cfg: ModelConfig, reader: CheckpointReader, budget: int
) -> EngineConfig:
    """`auto` -> resident when every expert fits the budget, else the profile's recommendation
    for the expert format, else offload; logs the choice and why. Other strategies pass through."""
    if config.moe_strategy != "auto":
        return config
    need = resident_bytes(config, cfg, reader)
    margin = f"{config.memory_margin_gib:g} GiB margin"
    fits = f"resident needs {need / GIB:.2f} GiB with the {margin} of {budget / GIB:.2f} GiB"
    if need <= budget:
        chosen, why = "resident", f"all {cfg.total_experts} experts fit: {fits}"
    else:
        chosen, why = _from_profile(lookup_profile(config), config.expert_format)
        why += f"; {fits}"
    cache_flags = config.moe_cache_size or config.moe_cache_rate or config.moe_cache_auto
    if chosen == "resident" and cache_flags:
        why += "; --moe-cache-* ignored"
    log.info(f"--moe-strategy auto resolved {chosen} ({why})")
    if chosen == "resident":  # cache flags mean nothing there
        return replace(config, moe_strategy=chosen, moe_cache_size=None, moe_cache_rate=None,
                       moe_cache_auto=False)  # fmt: skip
    return replace(config, moe_strategy=chosen)


def _from_profile(lookup: ProfileLookup, fmt: str) -> tuple[str, str]:
    d = lookup.decision
    if d is None:
        return "offload", f"no usable bandwidth profile: {lookup.problem}"
    where = f"bandwidth profile {lookup.path}: {fmt}"
    if d.ratio is None:
        return d.recommended, f"{where}: {d.note}"
    cmp = ">=" if d.ratio >= d.threshold else "<"
    return d.recommended, f"{where} ratio {d.ratio:.2f} {cmp} {d.threshold}"


def resident_bytes(config: EngineConfig, cfg: ModelConfig, reader: CheckpointReader) -> int:
    """Device bytes of resident: dense weights + KV cache + every routed expert + the margin,
    from the checkpoint's headers (nothing is loaded yet)."""
    dtype = torch_dtype(config.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    dense = sum(math.prod(reader.shape(n)) for n in reader.names() if not is_routed_expert(n))
    per_expert = get_format(cfg.expert_format).expert_bytes(
        cfg.hidden_size, cfg.moe_intermediate_size, dtype
    )
    max_len, slots = plan_kv(config, cfg)
    tokens = slots * max_len
    kv = KVCache.bytes_needed(cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim, dtype)
    experts = cfg.total_experts * per_expert
    return dense * elem + experts + kv + int(config.memory_margin_gib * GIB)


def resolve_max_fetch(config: EngineConfig) -> float:
    """hybrid's fraction of each step's misses fetched over PCIe; logs the seed's line."""
    if config.moe_hybrid_max_fetch != "auto":
        fraction = float(config.moe_hybrid_max_fetch)
        log.info(
            f"--moe-hybrid-max-fetch {fraction:g}: fetching {fraction:.1%} of each decode step's"
            " expert misses over PCIe (set by flag), the rest on the CPU"
        )
        return fraction
    lookup = lookup_profile(config)
    d = lookup.decision
    if d is not None and d.fetch_fraction is not None:
        log.info(fetch_log_line(d))
        return d.fetch_fraction
    why = lookup.problem or f"{lookup.path} has no overlapped numbers for {d.fmt}: {d.note}"
    log.warning(
        f"--moe-hybrid-max-fetch auto: no usable bandwidth profile ({why}); fetching "
        f"{FALLBACK_MAX_FETCH:.1%} of each decode step's expert misses over PCIe (fallback), "
        "the rest on the CPU"
    )
    return FALLBACK_MAX_FETCH
