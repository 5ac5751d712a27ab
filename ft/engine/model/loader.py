"""Reads a Hugging Face safetensors checkpoint: dense weights to the device, routed experts
into the host expert store. Reads every expert layout real checkpoints use: per-expert
(`mlp.experts.{e}.gate_proj/up_proj/down_proj`, Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`)
and fused 3-D (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]). Quantised
experts (config.json's quantization_config names the format) are read per expert, each
projection's weight and scale tensors under the names the format's public checkpoints use,
and kept quantised in the store. Dense projections must be float (routed experts only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ft.engine.config import ModelConfig
from ft.engine.experts.store import HostExpertStore
from ft.engine.formats.base import PROJECTIONS
from ft.errors import FtError

# per-expert names: (gate, up, down) under `{prefix}.experts.{e}.`
_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
_MOE_PREFIXES = ("mlp", "block_sparse_moe")
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")


class CheckpointReader:
    """Tensor name -> shard file, from the index or by listing every *.safetensors file."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        self._files = {}
        self._where = {}
        for shard in self._shards():
            try:
                handle = safe_open(str(shard), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise FtError(f"cannot read checkpoint shard {shard}: {exc}") from None
            self._files[shard] = handle
            for name in handle.keys():
                self._where[name] = handle

    def _shards(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError):
                raise FtError(f"{index} is not a valid safetensors index") from None
            shards = sorted({self.dir / f for f in weight_map.values()})
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise FtError(f"no *.safetensors weights in model directory {self.dir}")
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise FtError(f"checkpoint shard missing: {missing[0]}")
        return shards

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the shard's header, without reading its data."""
        if name not in self._where:
            raise FtError(f"checkpoint lacks tensor {name}")
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise FtError(f"checkpoint lacks tensor {name}")
        try:
            return self._where[name].get_tensor(name)
        except Exception as exc:
            raise FtError(f"cannot read tensor {name}: {exc}") from None


def is_routed_expert(name: str) -> bool:
    return any(f".{p}.experts." in name for p in _MOE_PREFIXES)


def load_dense(
    reader: CheckpointReader, cfg: ModelConfig, device, dtype
) -> dict[str, torch.Tensor]:
    """Every non-expert tensor, on the device in the engine's dtype, under its HF name."""
    weights = {}
    for name in reader.names():
        if name.endswith(_SCALE_SUFFIXES) and not is_routed_expert(name):
            raise FtError(
                f"{name}: quantised dense projections are not supported (the engine reads "
                "quantised routed experts only; dense weights must be float)"
            )
        if not is_routed_expert(name):
            weights[_canonical(name)] = reader.get(name).to(device=device, dtype=dtype)
    if "lm_head.weight" not in weights:
        if not cfg.tie_word_embeddings and "model.embed_tokens.weight" not in weights:
            raise FtError("checkpoint lacks lm_head.weight and model.embed_tokens.weight")
        weights["lm_head.weight"] = weights.get("model.embed_tokens.weight")
    return weights


def _canonical(name: str) -> str:
    """Mixtral's `block_sparse_moe.gate` is the router; the model reads it as `mlp.gate`."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def load_experts(reader: CheckpointReader, cfg: ModelConfig, dtype) -> HostExpertStore:
    """All routed experts into host memory, in the contract layout of cfg.expert_format."""
    store = HostExpertStore.allocate(
        cfg.num_layers, cfg.moe_layers, cfg.num_experts, cfg.hidden_size,
        cfg.moe_intermediate_size, dtype, cfg.expert_format,
    )  # fmt: skip
    for layer in cfg.moe_layers:
        bank = store.banks[layer]
        if store.format.quantized:
            _fill_quantized(reader, cfg, layer, store)
        else:
            _fill_layer(reader, cfg, layer, bank["w13"], bank["w2"])
    return store


def _fill_quantized(reader, cfg: ModelConfig, layer: int, store: HostExpertStore) -> None:
    """Per-expert tensors `{base}.{e}.{proj}.{suffix}`, as the format names them."""
    form, base = store.format, f"model.layers.{layer}.{cfg.moe_prefix}.experts"
    names = dict(zip(PROJECTIONS, _EXPERT_NAMES[cfg.model_type], strict=True))
    if not reader.has(f"{base}.0.{names['gate']}.weight"):
        raise FtError(f"checkpoint has no routed experts for layer {layer}")
    for e in range(cfg.num_experts):
        for proj, tensors in form.projections(store.expert(layer, e)).items():
            rows, cols = form.projection_shape(proj, cfg.hidden_size, cfg.moe_intermediate_size)
            for suffix, dst in tensors.items():
                name = f"{base}.{e}.{names[proj]}.{suffix}"
                src = _checked(reader, name, form.checkpoint_shape(suffix, rows, cols), dst)
                dst.copy_(src.reshape(dst.shape))


def _fill_layer(reader, cfg: ModelConfig, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
    inter = cfg.moe_intermediate_size
    for prefix in _MOE_PREFIXES:
        base = f"model.layers.{layer}.{prefix}.experts"
        if reader.has(f"{base}.gate_up_proj"):  # fused 3-D layout (transformers 5 in memory)
            _copy_checked(w13, reader.get(f"{base}.gate_up_proj"), f"{base}.gate_up_proj")
            _copy_checked(w2, reader.get(f"{base}.down_proj"), f"{base}.down_proj")
            return
        for gate, up, down in _EXPERT_NAMES.values():
            if reader.has(f"{base}.0.{gate}.weight"):
                for e in range(cfg.num_experts):
                    for dst, part in ((w13[e, :inter], gate), (w13[e, inter:], up), (w2[e], down)):
                        name = f"{base}.{e}.{part}.weight"
                        _copy_checked(dst, reader.get(name), name)
                return
    raise FtError(f"checkpoint has no routed experts for layer {layer}")


def _checked(reader, name: str, shape: tuple[int, ...], dst: torch.Tensor) -> torch.Tensor:
    """A quantised expert tensor, of the checkpoint shape; weight codes in dst's dtype (scales
    may come in another float dtype, e.g. bf16: copy_ converts them)."""
    src = reader.get(name)
    if tuple(src.shape) != shape:
        raise FtError(f"{name} has shape {tuple(src.shape)}, expected {shape}")
    is_scale = not name.endswith(".weight") and src.dtype.is_floating_point
    if src.dtype != dst.dtype and not (is_scale and dst.dtype.is_floating_point):
        raise FtError(f"{name} is {src.dtype}, expected {dst.dtype}")
    return src


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise FtError(f"{name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
