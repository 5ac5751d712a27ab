"""The peer baseline of `ft bench decode --peer accelerate`: what most users try first, i.e.
transformers + accelerate with `device_map="auto"` and `max_memory` offloading the same
checkpoint within the same GPU budget. Same prompts, greedy, the same warm-up and timed steps,
each decode step timed on its own (one forward with the KV cache, argmax, device sync)."""

from __future__ import annotations

import gc
import inspect
import statistics
import time

import torch

from ft.engine.config import torch_dtype
from ft.errors import FtError


def run_accelerate(cfg, base, prompts: dict[int, list[list[int]]], progress) -> list[dict]:
    """One result per batch size, shaped like the engine's rows (no roofline: no counters).
    `prompts`: batch size -> the token ids the engine decoded at that batch."""
    progress("accelerate: loading the checkpoint with transformers", 0)
    try:
        model = load_peer_model(base.model, base.device, base.dtype, base.gpu_memory_limit)
    except (ImportError, FtError) as exc:
        progress("accelerate: skipped", len(cfg.batches) * (cfg.warmup + cfg.tokens))
        return [_row(b, None, error=str(exc).split("\n")[0]) for b in cfg.batches]
    try:
        return [
            _row(b, *_measure(model, prompts[b], cfg, base.device, progress), None)
            for b in cfg.batches
        ]
    finally:
        del model
        gc.collect()
        if base.device == "cuda":
            torch.cuda.empty_cache()


def load_peer_model(model_dir: str, device: str, dtype: str, gpu_memory_limit: float | None):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise FtError("--peer accelerate needs transformers and accelerate (pip install "
                      "'freetoken[peer]')") from None  # fmt: skip
    kwargs: dict = {"dtype": torch_dtype(dtype)}
    if device == "cuda":
        import accelerate  # noqa: F401  # device_map needs it; fail with the hint above if absent

        kwargs["device_map"] = "auto"
        if gpu_memory_limit is not None:  # the engine's budget; the rest goes to host memory
            kwargs["max_memory"] = {torch.cuda.current_device(): f"{gpu_memory_limit}GiB",
                                    "cpu": "1024GiB"}  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()


@torch.inference_mode()
def _measure(model, prompts: list[list[int]], cfg, base_device: str, progress):
    """-> (seconds of each timed decode step, placement)."""
    device = torch.device(base_device)  # accelerate's hooks move inputs where each module runs
    ids = torch.tensor(prompts, device=device)
    batch = len(prompts)
    cache_arg = _cache_argument(model)
    out = model(input_ids=ids, use_cache=True)  # prefill, not timed
    seconds = []
    for step in range(cfg.warmup + cfg.tokens):
        start = time.perf_counter()
        past = {cache_arg: getattr(out, cache_arg)}
        out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **past)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= cfg.warmup:
            seconds.append(time.perf_counter() - start)
        progress(f"accelerate batch {batch}", 1)
    placement = sorted({str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()})
    return seconds, {"device_map": placement}


def _cache_argument(model) -> str:
    """transformers >= 5.x names the KV cache `cache`; older ones `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _row(batch: int, seconds: list[float] | None, extra: dict | None = None, error=None) -> dict:
    row = {"strategy": "peer:accelerate", "batch": batch, "kernel": "transformers", "error": error}
    if seconds is None:
        return {**row, "tok_s": None}
    return {
        **row, "steps": len(seconds), "tok_s": batch * len(seconds) / sum(seconds),
        "step_ms_median": 1e3 * statistics.median(seconds),
        "step_ms": [round(1e3 * s, 3) for s in seconds], "peer": extra,
        "per_step": None, "roofline": None, "ratio": None,
    }  # fmt: skip
