"""Builds an engine's parts from an EngineConfig, logging the startup lines probes parse."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ft import settings
from ft.engine.config import EngineConfig, ModelConfig, torch_dtype
from ft.engine.experts.grouped import pick_backend
from ft.engine.experts.store import HostExpertStore
from ft.engine.memory import (
    GIB,
    cap_device_memory,
    check_resident_fits,
    memory_budget,
    plan_kv,
    resolve_cache_size,
    tensor_bytes,
)
from ft.engine.model.attention import KVCache, Rope
from ft.engine.model.decoder import MoeModel
from ft.engine.model.loader import CheckpointReader, load_dense, load_experts
from ft.engine.model.tokenizer import load_tokenizer, stop_token_ids
from ft.engine.resolve import resolve_max_fetch, resolve_strategy
from ft.engine.strategies import MoeStrategy, build_strategy
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.engine")


@dataclass
class EngineParts:
    config: EngineConfig  # as resolved (`auto` replaced by the strategy it chose)
    model_config: ModelConfig
    model: MoeModel
    strategy: MoeStrategy
    tokenizer: object
    max_model_len: int
    num_slots: int  # sequences the KV cache holds at once
    cache_size: int | None  # expert cache slots (offload); None when resident
    stop_token_ids: set[int]


def build_engine_parts(
    config: EngineConfig, expert_store: HostExpertStore | None = None
) -> EngineParts:
    """`expert_store`: a store already loaded from this checkpoint in this dtype (benchmarks
    build several engines from one load); None loads it."""
    cfg = ModelConfig.from_dir(config.model)
    tokenizer = load_tokenizer(config.model, cfg.eos_token_id)  # cheap checks before the load
    max_len, slots = plan_kv(config, cfg)
    reader = CheckpointReader(config.model)  # headers only: `auto` sizes resident from them
    budget = memory_budget(config)
    config = resolve_strategy(config, cfg, reader, budget)  # `auto` -> what it chose
    log.info(f"Resolved config: {config.describe()}")
    dtype = torch_dtype(config.dtype)
    log.info(f"Free memory before loading model: {budget / GIB:.2f} GiB")
    cap_device_memory(config)
    start = time.perf_counter()
    weights = load_dense(reader, cfg, config.device, dtype)
    store = expert_store or load_experts(reader, cfg, dtype)
    check_store(store, cfg, dtype)
    dense = tensor_bytes({t.data_ptr(): t for t in weights.values()}.values())
    seconds, experts_gib = time.perf_counter() - start, store.total_bytes / GIB
    log.info(
        f"Loaded weights in {seconds:.1f} s: dense {dense / GIB:.2f} GiB on {config.device}, "
        f"{store.total_experts} experts {experts_gib:.2f} GiB in host memory"
    )
    kv_bytes = KVCache.bytes_needed(
        cfg.num_layers, slots * max_len, cfg.num_kv_heads, cfg.head_dim, dtype
    )
    used = dense + kv_bytes
    log.info(f"MoE experts: {config.expert_format} via {pick_backend(config.device)}")
    strategy, cache_size = _strategy(config, cfg, store, budget, used)
    try:
        kv = KVCache(
            cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype, config.device
        )
        rope = Rope(cfg.head_dim, cfg.rope_theta, max_len, config.device)
        model = MoeModel(cfg, weights, strategy, kv, rope)
        stops = stop_token_ids(config.model, tokenizer.eos_token_id)
    except BaseException:
        strategy.close()  # hybrid's pool threads and torch's thread count
        raise
    asked = settings.decode_attention()  # say whether it took effect (not on the CPU)
    log.info(f"Decode attention: {model.layers[0].decode} (FT_DECODE_ATTENTION={asked})")
    return EngineParts(config, cfg, model, strategy, tokenizer, max_len, slots, cache_size, stops)


def check_store(store: HostExpertStore, cfg: ModelConfig, dtype) -> None:
    """A reused store must be this checkpoint's, in this dtype."""
    shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.moe_layers)
    if (store.num_experts, store.hidden_size, store.intermediate_size, store.moe_layers) != shape:
        raise FtError("the given expert store does not match the checkpoint's expert shape")
    if store.dtype != dtype:
        raise FtError(f"the given expert store is {store.dtype}, the engine runs {dtype}")
    if store.fmt != cfg.expert_format:
        raise FtError(f"the given expert store is {store.fmt}, the checkpoint {cfg.expert_format}")


def _strategy(config: EngineConfig, cfg: ModelConfig, store, budget: int, used: int):
    """-> (strategy, expert cache slots or None)."""
    if config.moe_strategy == "resident":
        check_resident_fits(config, store, budget, used)
        return build_strategy(config, store), None
    size, rate = resolve_cache_size(config, store, budget, used)
    if config.moe_cache_size is None and config.moe_cache_rate is None:
        log.info(f"--moe-cache-auto resolved moe_cache_size={size} (rate {rate:.3f})")
    mib, gib = store.expert_bytes / 2**20, size * store.expert_bytes / GIB
    log.info(f"MoE expert cache: {size} slots of {mib:.2f} MiB (rate {rate:.3f}), {gib:.2f} GiB")
    fetch = resolve_max_fetch(config) if config.moe_strategy == "hybrid" else None
    return build_strategy(config, store, size, top_k=cfg.top_k, max_fetch=fetch), size
