"""Writes a safetensors checkpoint shard by shard, with the Hugging Face index."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ft.engine.config import ModelConfig
from ft.engine.formats import get_format


def shard_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Shards of at most 2 GiB; small models still get a few shards (the index is exercised)."""
    expert = get_format(cfg.expert_format).expert_bytes(
        cfg.hidden_size, cfg.moe_intermediate_size, dtype
    )
    total = (
        cfg.num_experts * cfg.num_layers * expert
        + 2 * cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    )
    return max(1, min(2 << 30, total // 3))


class ShardWriter:
    """Buffers tensors and writes a safetensors shard whenever the buffer passes the limit.
    A shard is written by a background thread while the next one is drawn; at most one
    write is in flight, so memory stays at about two shards."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.buffer: dict[str, torch.Tensor] = {}
        self.size, self.files, self.where = 0, [], {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-shard-writer")
        self._pending: Future | None = None

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Store `name` in the checkpoint's dtype; -> the stored values, as float32."""
        stored = tensor.to(dtype).contiguous()
        self.add_stored(name, stored)
        return stored.float()

    def add_stored(self, name: str, stored: torch.Tensor) -> None:
        """Store a tensor already in the checkpoint's dtype (contiguous, not sharing memory)."""
        self.buffer[name] = stored
        self.size += stored.numel() * stored.element_size()
        if self.size >= self.limit:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buffer:
            return
        self._wait()
        path = self.out / f"shard-{len(self.files):05d}.tmp"
        self._pending = self._writer.submit(save_file, self.buffer, str(path), {"format": "pt"})
        self.files.append(path)
        self.where.update({name: path for name in self.buffer})
        self.buffer, self.size = {}, 0

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a failed write here
            self._pending = None

    def finish(self) -> None:
        """Name the shards model-0000k-of-0000N.safetensors and write the index."""
        self._flush()
        self._wait()
        self._writer.shutdown()
        n, names = len(self.files), {}
        for k, path in enumerate(self.files, 1):
            names[path] = f"model-{k:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / names[path])
        total = sum((self.out / f).stat().st_size for f in names.values())
        index = {"metadata": {"total_size": total}, "weight_map": {}}
        index["weight_map"] = {name: names[p] for name, p in sorted(self.where.items())}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
