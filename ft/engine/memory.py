"""Device memory accounting and expert-cache sizing (--moe-cache-size / -rate / -auto)."""

from __future__ import annotations

import torch

from ft.engine.config import EngineConfig, ModelConfig
from ft.engine.experts.store import HostExpertStore
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.engine")
GIB = 1 << 30
DEFAULT_MAX_MODEL_LEN = 4096


def free_device_bytes(device: str) -> int:
    """Free memory on the device; on the CPU device, available host memory plays that role."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available


def memory_budget(config: EngineConfig) -> int:
    """What the engine may use: the device's free memory, capped by --gpu-memory-limit."""
    free = free_device_bytes(config.device)
    if config.gpu_memory_limit is not None:
        free = min(free, int(config.gpu_memory_limit * GIB))
    return free


def cap_device_memory(config: EngineConfig) -> None:
    """Make --gpu-memory-limit binding on CUDA: allocations past it fail as on a small card."""
    if config.device != "cuda" or config.gpu_memory_limit is None:
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, config.gpu_memory_limit * GIB / total))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def resolve_cache_size(
    config: EngineConfig, store: HostExpertStore, budget: int, used: int
) -> tuple[int, float]:
    """Slots for the offload cache, and that as a rate of all experts. `used` is what dense
    weights and the KV cache already take from `budget`."""
    total = store.total_experts
    if config.moe_cache_size is not None:
        size = config.moe_cache_size
    elif config.moe_cache_rate is not None:
        size = max(1, round(config.moe_cache_rate * total))
    else:  # --moe-cache-auto, also offload's default
        room = budget - used - int(config.memory_margin_gib * GIB)
        size = min(total, room // store.expert_bytes)
        if size < 1:
            raise FtError(
                f"--moe-cache-auto: no room for one expert ({budget / GIB:.2f} GiB budget, "
                f"{used / GIB:.2f} GiB dense weights + KV, {config.memory_margin_gib} GiB margin)"
            )
    if size > total:
        raise FtError(f"moe_cache_size {size} is larger than the expert count {total}")
    return size, size / total


def check_resident_fits(config: EngineConfig, store: HostExpertStore, budget: int, used: int):
    """With an explicit --gpu-memory-limit, resident must fit in it."""
    need = used + store.total_bytes
    if config.gpu_memory_limit is not None and need > budget:
        raise FtError(
            f"resident needs {need / GIB:.2f} GiB but only {budget / GIB:.2f} GiB is allowed; "
            "use --moe-strategy offload"
        )


def plan_kv(config: EngineConfig, cfg: ModelConfig) -> tuple[int, int]:
    """(max_model_len, sequence slots): slots of max_model_len tokens within kv_reserve_tokens."""
    max_len = config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_len > cfg.max_position_embeddings:
        raise FtError(
            f"max_model_len {max_len} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    if cfg.sliding_window and max_len > cfg.sliding_window:
        log.warning(
            f"max_model_len {max_len} capped to the model's sliding_window {cfg.sliding_window}"
        )
        max_len = cfg.sliding_window  # within the window, full attention is the same thing
    if config.kv_reserve_tokens is None:
        return max_len, config.max_num_seqs
    max_len = min(max_len, config.kv_reserve_tokens)
    return max_len, config.kv_reserve_tokens // max_len  # reserve what was asked for
