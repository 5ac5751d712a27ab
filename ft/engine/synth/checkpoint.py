"""`ft model synth`: a synthetic Qwen3-MoE checkpoint in the Hugging Face layout, written
shard by shard (a 60 GB preset never sits in memory whole).

Routers are drawn from the hidden states the checkpoint itself produces: a sample of token
sequences is run through each layer as it is made (real attention, real experts), and
the layer's router reads (a) the shared direction of those hidden states, weighted per
expert with a Zipf-like bias (skewed popularity), and (b) their slowly drifting low-rank part
(consecutive tokens reuse experts). The routing statistics printed are measured on that sample.

`expert_format` other than bf16: the float experts drawn are quantised by the format (a chunk
of experts at a time), written under the names its public checkpoints use, with config.json's
`quantization_config`; the sample runs through the dequantised experts, so the routing stats
describe the checkpoint written. Dense weights stay in `dtype`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ft.cpuinfo import allowed_cores
from ft.engine.config import ModelConfig, torch_dtype
from ft.engine.experts.dispatch import add_expert, group_by_expert
from ft.engine.formats import get_format
from ft.engine.formats.base import PROJECTIONS
from ft.engine.model.attention import Batch, Rope, Span
from ft.engine.model.decoder import LAYER_TENSORS, DecoderLayer
from ft.engine.model.fused import rms_norm
from ft.engine.model.presets import preset_hf_config
from ft.engine.model.shards import ShardWriter, shard_bytes
from ft.engine.synth.tokenizer import build_tokenizer, save_tokenizer
from ft.errors import FtError

SAMPLE_SEQS, SAMPLE_LEN = 4, 64  # routing sample: sequences x tokens
ZIPF, DRIFT, NOISE = 1.0, 1.5, 0.5  # router logit scales: popularity, slow drift, per-token


@dataclass
class RoutingStats:
    top20_share: float  # share of routed (token, expert) pairs taken by the top 20% of experts
    reuse_rate: float  # share of a token's experts also used by the previous token
    uniform_reuse: float  # what a uniform router would give: top_k / experts
    tokens: int
    layers: int

    def describe(self) -> str:
        return (
            f"routing measured on {self.tokens} sample tokens over {self.layers} MoE layers: "
            f"top 20% of experts take {self.top20_share:.1%} of routed tokens (uniform 20.0%); "
            f"consecutive tokens reuse {self.reuse_rate:.1%} of experts "
            f"(uniform {self.uniform_reuse:.1%})"
        )


def synth_checkpoint(
    preset: str, out: str | Path, layers: int | None = None, experts: int | None = None,
    dtype: str = "bfloat16", seed: int = 0, on_layer=None, expert_format: str = "bf16",
) -> RoutingStats:  # fmt: skip
    """Write the checkpoint to `out` (which must not exist or be empty); -> routing stats.
    `on_layer(done, total)` is called after each layer (progress for people)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FtError(f"{out} already exists and is not an empty directory")
    hf = preset_hf_config(preset, layers, experts, dtype)
    form = get_format(expert_format)
    form.check_shape(hf["hidden_size"], hf["moe_intermediate_size"])
    if form.quantized:
        hf["quantization_config"] = form.quantization_config()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        stats = _write(hf, tmp, torch_dtype(dtype), seed, on_layer or (lambda done, total: None))
        if out.exists():
            out.rmdir()
        tmp.rename(out)  # the checkpoint appears whole or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def _write(hf: dict, out: Path, dtype: torch.dtype, seed: int, on_layer) -> RoutingStats:
    tok = build_tokenizer(hf["vocab_size"])
    hf["eos_token_id"] = save_tokenizer(tok, out, hf["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    cfg = ModelConfig.from_dict(hf)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out, shard_bytes(cfg, dtype))
    common = _randn(gen, cfg.hidden_size)
    common = common / common.norm() * math.sqrt(cfg.hidden_size)  # shared by every token
    embed = _randn(gen, cfg.vocab_size, cfg.hidden_size, scale=0.8).add_(0.6 * common)
    h = writer.add("model.embed_tokens.weight", embed, dtype)[_sample_ids(gen, cfg)]
    del embed
    routes = []
    for layer in range(cfg.num_layers):
        h, ids = _make_layer(cfg, layer, h, gen, writer, dtype)
        routes.append(ids)
        on_layer(layer + 1, cfg.num_layers)
    writer.add("model.norm.weight", torch.ones(cfg.hidden_size), dtype)
    writer.add("lm_head.weight", _draw_lm_head(cfg, h, gen), dtype)
    writer.finish()
    return measure_routing(routes, cfg)


def _draw_lm_head(cfg: ModelConfig, h: torch.Tensor, gen) -> torch.Tensor:
    """Random rows blind to the direction all final hidden states share, so the output
    token depends on the context rather than on that shared part."""
    lm_head = _randn(gen, cfg.vocab_size, cfg.hidden_size, scale=2.0 / math.sqrt(cfg.hidden_size))
    shared = rms_norm(h, torch.ones(cfg.hidden_size), cfg.rms_norm_eps).mean(0)
    shared = shared / shared.norm().clamp_min(1e-6)
    return lm_head.addr_(lm_head @ shared, shared, alpha=-1.0)  # in place: it is 1.2 GB at 30B


_CHUNK = 1 << 22  # elements per independently seeded piece: the result never depends on threads
_POOL = ThreadPoolExecutor(max_workers=len(allowed_cores()) or 1, thread_name_prefix="ft-synth")


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """N(0, scale^2) filled in parallel (torch's CPU randn runs on one core: minutes at 30B)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    out = torch.empty(shape)
    flat = out.view(-1)

    def fill(i: int) -> None:
        piece = torch.Generator().manual_seed(seed + i)
        flat[i * _CHUNK : (i + 1) * _CHUNK].normal_(0.0, scale, generator=piece)

    list(_POOL.map(fill, range(max(1, -(-flat.numel() // _CHUNK)))))
    return out


def _sample_ids(gen: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size - 1, (SAMPLE_SEQS * SAMPLE_LEN,), generator=gen)


def _make_layer(cfg: ModelConfig, layer: int, h, gen, writer, dtype):
    """Draw, write and run one decoder layer on the sample -> (next hidden, topk ids)."""
    D, L = cfg.hidden_size, cfg.num_layers  # noqa: N806
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out_scale = 1.0 / math.sqrt(2 * L)  # keeps the residual stream's growth bounded over depth
    w = {
        "ln1": torch.ones(D), "ln2": torch.ones(D),
        "q": _randn(gen, qd, D, scale=D**-0.5), "k": _randn(gen, kvd, D, scale=D**-0.5),
        "v": _randn(gen, kvd, D, scale=D**-0.5),
        "o": _randn(gen, D, qd, scale=qd**-0.5 * out_scale),
        "q_norm": torch.ones(cfg.head_dim), "k_norm": torch.ones(cfg.head_dim),
    }  # fmt: skip
    w = {k: _store(writer, layer, k, v, dtype) for k, v in w.items()}
    block = DecoderLayer(cfg, layer, w, _sample_rope(cfg), _sample_kv(cfg), moe=None)
    h = h + block.attention(rms_norm(h, w["ln1"], cfg.rms_norm_eps), _sample_batch())
    x = rms_norm(h, w["ln2"], cfg.rms_norm_eps)
    w["router"] = _store(writer, layer, "router", draw_router(cfg, x, gen), dtype)
    experts = _write_experts(cfg, layer, gen, writer, dtype, out_scale)
    recorder = _Recorder(*experts, cfg.num_experts)
    block.moe = recorder
    return h + block.sparse_mlp(x), recorder.ids


def _store(writer, layer: int, short: str, tensor, dtype) -> torch.Tensor:
    return writer.add(f"model.layers.{layer}.{LAYER_TENSORS[short]}", tensor, dtype)


def draw_router(cfg: ModelConfig, x: torch.Tensor, gen) -> torch.Tensor:
    """Router rows [E, D] reading the sample's shared direction (Zipf bias) and its slow part."""
    E, D = cfg.num_experts, cfg.hidden_size  # noqa: N806
    mean = x.mean(0)  # [D] what every token shares
    rank = torch.randperm(E, generator=gen).float()  # each layer has its own popular experts
    bias = -ZIPF * torch.log1p(rank)  # [E] Zipf-like: popularity ~ 1 / (1 + rank)
    rows = bias[:, None] * (mean / mean.pow(2).sum())[None, :]  # row . mean == bias
    slow = _slow_directions(x - mean, rank=min(8, D))  # [D, r]
    proj = (x - mean) @ slow  # [N, r]
    z = _randn(gen, E, slow.shape[1])
    rows = rows + DRIFT * (z / proj.std(0).clamp_min(1e-6)) @ slow.T / math.sqrt(slow.shape[1])
    noise_scale = NOISE / (x - mean).norm(dim=-1).mean().clamp_min(1e-6)
    return rows + _randn(gen, E, D) * noise_scale


def _slow_directions(centered: torch.Tensor, rank: int) -> torch.Tensor:
    """Top principal directions of the sample smoothed along each sequence (what drifts slowly)."""
    seqs = centered.view(SAMPLE_SEQS, SAMPLE_LEN, -1)
    smooth = seqs.cumsum(1) / torch.arange(1, SAMPLE_LEN + 1)[None, :, None]  # running mean
    _, _, vh = torch.linalg.svd(smooth.reshape(-1, centered.shape[1]), full_matrices=False)
    return vh[:rank].T


def _write_experts(cfg: ModelConfig, layer: int, gen, writer, dtype, out_scale: float):
    """All experts of a layer, written per expert as HF names them; -> (the layer's bank as
    stored, its format) for the sample run. Float experts are three big draws; quantised ones
    are drawn, quantised and written a chunk of experts at a time, so the float32 draws never
    sit in memory whole (seed-next's layer is 10 GB of them)."""
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size  # noqa: N806, E741
    base = f"model.layers.{layer}.mlp.experts"
    form = get_format(cfg.expert_format)
    if form.quantized:
        return _write_quantized(form, base, gen, (E, D, I), out_scale, writer), form
    parts = {
        "gate_proj": _randn(gen, E, I, D, scale=D**-0.5).to(dtype),
        "up_proj": _randn(gen, E, I, D, scale=D**-0.5).to(dtype),
        "down_proj": _randn(gen, E, D, I, scale=out_scale * I**-0.5).to(dtype),
    }
    for e in range(E):
        for part, stored in parts.items():  # clone: safetensors refuses tensors sharing memory
            writer.add_stored(f"{base}.{e}.{part}.weight", stored[e].clone())
    w13 = torch.cat((parts["gate_proj"], parts["up_proj"]), dim=1)
    return {"w13": w13, "w2": parts["down_proj"]}, form


_QUANT_CHUNK = 1 << 27  # float32 elements drawn at once per projection (512 MB)


def _write_quantized(form, base: str, gen, shape, out_scale: float, writer) -> dict:
    """Draw, quantise (vectorised over a chunk of experts) and write each expert's tensors as
    the format names them; -> the layer's quantised bank."""
    E, D, I = shape  # noqa: N806, E741
    per = max(1, _QUANT_CHUNK // (I * D))
    chunks = []
    for start in range(0, E, per):
        n = min(per, E - start)
        gate_up = _randn(gen, n, 2 * I, D, scale=D**-0.5)  # gate rows, then up rows
        chunk = form.quantize(gate_up, _randn(gen, n, D, I, scale=out_scale * I**-0.5))
        del gate_up
        for e in range(n):
            _write_quantized_expert(form, f"{base}.{start + e}", chunk, e, (D, I), writer)
        chunks.append(chunk)
    return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}


def _write_quantized_expert(form, prefix: str, chunk: dict, e: int, shape, writer) -> None:
    hidden, inter = shape
    names = dict(zip(PROJECTIONS, ("gate_proj", "up_proj", "down_proj"), strict=True))
    for proj, tensors in form.projections({k: v[e] for k, v in chunk.items()}).items():
        rows, cols = form.projection_shape(proj, hidden, inter)
        for suffix, t in tensors.items():
            shape = form.checkpoint_shape(suffix, rows, cols)
            writer.add_stored(f"{prefix}.{names[proj]}.{suffix}", t.reshape(shape).clone())
        for suffix, value in form.constants.items():
            writer.add_stored(f"{prefix}.{names[proj]}.{suffix}", torch.tensor(value))


class _Recorder:
    """Stands in for a strategy while synth runs the sample: records routing, computes each
    routed expert from the layer's bank as stored (dequantised one expert at a time)."""

    def __init__(self, bank: dict, form, num_experts: int):
        self.bank, self.form, self.num_experts, self.ids = bank, form, num_experts, None

    def forward(self, layer, x, topk_ids, topk_weights):
        self.ids = topk_ids
        out = torch.zeros_like(x)
        for group in group_by_expert(topk_ids, topk_weights, self.num_experts):
            expert = {name: t[group.expert] for name, t in self.bank.items()}
            w13, w2 = self.form.dequantize(expert, torch.float32)
            add_expert(out, x, group, w13, w2)
        return out


def _sample_rope(cfg: ModelConfig) -> Rope:
    return Rope(cfg.head_dim, cfg.rope_theta, SAMPLE_LEN, "cpu")


def _sample_kv(cfg: ModelConfig):
    shape = (SAMPLE_SEQS, SAMPLE_LEN, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


def _sample_batch() -> Batch:
    spans = [Span(s, 0, SAMPLE_LEN) for s in range(SAMPLE_SEQS)]
    positions = torch.arange(SAMPLE_LEN).repeat(SAMPLE_SEQS)
    return Batch(torch.zeros(0, dtype=torch.long), positions, spans, torch.arange(SAMPLE_SEQS))


def measure_routing(routes: list[torch.Tensor], cfg: ModelConfig) -> RoutingStats:
    """Skew and reuse of the recorded routing ([N, K] per layer, N = seqs x len)."""
    E, K = cfg.num_experts, cfg.top_k  # noqa: N806
    top = max(1, round(0.2 * E))
    shares, reuse = [], []
    for ids in routes:
        counts = torch.bincount(ids.flatten(), minlength=E).sort(descending=True).values
        shares.append(counts[:top].sum().item() / counts.sum().item())
        seq = ids.view(SAMPLE_SEQS, SAMPLE_LEN, K)
        same = (seq[:, 1:, :, None] == seq[:, :-1, None, :]).any(-1)  # [S, L-1, K]
        reuse.append(same.float().mean().item())
    n = len(routes)
    return RoutingStats(sum(shares) / n, sum(reuse) / n, K / E, SAMPLE_SEQS * SAMPLE_LEN, n)


def builtin_tiny() -> Path:
    """The built-in default model: the `tiny` preset, made once in FT_CACHE_DIR/models/tiny."""
    from ft import settings

    path = settings.cache_dir() / "models" / "tiny"
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            synth_checkpoint("tiny", path, dtype="float32", seed=0)
        except (OSError, FtError):
            if not (path / "config.json").is_file():  # not a concurrent maker that won
                raise
    return path
