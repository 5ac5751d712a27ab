"""The model's shape (from config.json) and the engine's settings (one frozen, self-checking
dataclass), and the synthetic presets."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ft import settings
from ft.errors import FtError

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
STRATEGIES = ("resident", "offload", "hybrid", "auto")  # auto resolves to one of the others
DTYPES = ("bfloat16", "float16", "float32")
EXPERT_FORMATS = ("bf16", "int8", "fp8_block", "nvfp4")  # ft.engine.formats.FORMATS, torch-free
MAX_PREFETCH_DEPTH = 4  # router guesses lose accuracy with distance; more buys nothing
# --moe-prefetch-depth auto, as (at batch 1, at larger batches). Device gates at batch 1 leave
# the link time for a third layer's guesses: +1.4% at b1, -1.4% at b4 (docs/performance.md);
# host stops and hybrid stay at 2 (depth 3 was slower there)
AUTO_PREFETCH_DEPTH = {"gates": (3, 2), "stops": (2, 2)}


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a Hugging Face config.json (Qwen3-MoE or Mixtral)."""

    model_type: str  # "qwen3_moe" | "mixtral"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense MLP layers (Qwen3 mlp_only_layers)
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    sliding_window: int | None = None  # the engine caps max_model_len here (no windowed attention)
    expert_format: str = "bf16"  # of the routed experts, from quantization_config

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def moe_prefix(self) -> str:  # HF module name of the sparse block
        return "mlp" if self.model_type == "qwen3_moe" else "block_sparse_moe"

    def is_moe_layer(self, layer: int) -> bool:
        if self.num_experts == 0 or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def total_experts(self) -> int:
        return self.num_experts * len(self.moe_layers)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not Path(path).is_dir():
            raise FtError(f"model directory not found: {path}")
        if not config_path.is_file():
            raise FtError(f"no config.json in model directory {path}")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise FtError(f"{config_path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = _model_type(raw)
        try:
            return _parse(raw, model_type)
        except (KeyError, TypeError, ValueError) as exc:
            raise FtError(f"config.json is missing or has a bad field: {exc}") from None


def _model_type(raw: dict) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and raw.get("model_type") in ARCHITECTURES.values():
        return raw["model_type"]
    known = ", ".join(ARCHITECTURES)
    name = ",".join(archs) or raw.get("model_type") or "none"
    raise FtError(f"unsupported architecture {name!r} (supported: {known})")


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise FtError(f"rope_type {rope_type!r} is not supported (only 'default')")
    if "rope_theta" in params:
        return _field(params, "rope_theta", float)
    return _field(raw, "rope_theta", float, 10000.0)


def _parse(raw: dict, model_type: str) -> ModelConfig:
    qwen = model_type == "qwen3_moe"
    hidden, heads = _field(raw, "hidden_size", int), _field(raw, "num_attention_heads", int)
    experts = "num_experts" if qwen and "num_experts" in raw else "num_local_experts"
    inter = _field(raw, "intermediate_size", int)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_field(raw, "vocab_size", int),
        hidden_size=hidden,
        num_layers=_field(raw, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, None) or heads,
        head_dim=_field(raw, "head_dim", int, None) or hidden // heads,
        num_experts=_field(raw, experts, int),
        top_k=_field(raw, "num_experts_per_tok", int),
        moe_intermediate_size=_field(raw, "moe_intermediate_size", int) if qwen else inter,
        intermediate_size=inter,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if qwen else True,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=_rope_theta(raw),
        max_position_embeddings=_field(raw, "max_position_embeddings", int, 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        decoder_sparse_step=(_field(raw, "decoder_sparse_step", int, 1) or 1) if qwen else 1,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()) if qwen else (),
        eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        sliding_window=_sliding_window(raw, qwen),
        expert_format=_expert_format(raw),
    )


_REQUIRED = object()


def _field(raw: dict, name: str, kind: type, default: object = _REQUIRED):
    """config.json's `name` as an int or a float; an error names the field (a missing or
    null one takes the default where there is one)."""
    value = raw.get(name)
    if value is None:
        if default is _REQUIRED:
            raise FtError(f"config.json has no field '{name}'")
        return default
    fractional = kind is int and isinstance(value, float) and not value.is_integer()
    try:
        if isinstance(value, bool | dict | list) or fractional:
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        want = "an integer" if kind is int else "a number"
        raise FtError(f"config.json field '{name}' should be {want}, got {value!r:.40}") from None


def _expert_format(raw: dict) -> str:
    from ft.engine.formats import format_of  # torch: only where a checkpoint is read

    return format_of(raw.get("quantization_config"))


def _sliding_window(raw: dict, qwen: bool) -> int | None:
    if qwen and not raw.get("use_sliding_window", False):
        return None
    return _field(raw, "sliding_window", int, None) or None


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting; the engine is built from this and nothing else reads loose settings."""

    model: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    moe_strategy: str = "resident"
    expert_format: str | None = None  # None: the checkpoint's; given: must be the checkpoint's
    moe_cache_size: int | None = None
    moe_cache_rate: float | None = None
    moe_cache_auto: bool = False
    kv_reserve_tokens: int | None = None  # None: max_num_seqs * max_model_len
    gpu_memory_limit: float | None = None  # GiB the engine may use on the device
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: min(model's max positions, 4096)
    memory_margin_gib: float = 1.0  # kept free by --moe-cache-auto
    moe_hybrid_max_fetch: float | str = "auto"  # hybrid: fraction of misses fetched, or "auto"
    cpu_moe_threads: int | None = None  # None: physical cores - 1
    cpu_moe_inline: bool = False  # fault injection: CPU expert work on the engine thread
    moe_prefetch: bool = True  # offload, hybrid, graphed decode: prefetch guessed misses
    # how many layers ahead a stop (or device gates) prefetches guesses for; "auto": by batch
    moe_prefetch_depth: int | str = "auto"
    moe_prefetch_window: int | None = None  # guesses queued for copy at once; None: the strategy's
    # offload, hybrid: decode as one graph whose layers wait on device gates; None: the default
    moe_gates: bool | None = None
    bw_profile: str | None = None  # None: $FT_CACHE_DIR/benchbw.json

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _resolve_device(self.device))
        default_dtype = "bfloat16" if self.device == "cuda" else "float32"
        object.__setattr__(self, "dtype", self.dtype or default_dtype)
        check_choice("dtype", self.dtype, DTYPES)
        self._resolve_expert_format()
        check_choice("moe_strategy", self.moe_strategy, STRATEGIES)
        self._check_hybrid_flags()
        self._check_numbers()
        self._check_cache_flags()
        self._check_cache_fits_model()

    def _resolve_expert_format(self) -> None:
        """The checkpoint's format (config.json quantization_config); a different one asked for
        is a user error, not a conversion."""
        given = self.expert_format
        if given is not None:
            check_choice("expert_format", given, EXPERT_FORMATS)
        found = _checkpoint_format(self.model)
        if given is not None and found is not None and given != found:
            raise FtError(
                f"--expert-format {given} disagrees with the checkpoint, whose experts are "
                f"{found} (config.json quantization_config)"
            )
        object.__setattr__(self, "expert_format", found or given or "bf16")

    def _check_numbers(self) -> None:
        for name in ("moe_cache_size", "kv_reserve_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FtError(f"{name} must be at least 1, got {value}")
        if self.max_num_seqs < 1:
            raise FtError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.moe_cache_rate is not None and not 0 < self.moe_cache_rate <= 1:
            raise FtError(f"moe_cache_rate must be in (0, 1], got {self.moe_cache_rate}")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise FtError(f"gpu_memory_limit must be positive GiB, got {self.gpu_memory_limit}")
        if self.memory_margin_gib < 0:
            raise FtError(f"memory_margin_gib must not be negative, got {self.memory_margin_gib}")
        depth = check_prefetch_depth(self.moe_prefetch_depth)
        object.__setattr__(self, "moe_prefetch_depth", depth)
        if self.moe_gates and self.moe_strategy not in ("offload", "hybrid"):
            raise FtError(
                f"--moe-gates is offload's and hybrid's (got --moe-strategy {self.moe_strategy}):"
                " resident has no misses"
            )
        if self.moe_prefetch_window is not None and self.moe_prefetch_window < 0:
            raise FtError(f"moe_prefetch_window must be 0 or more, got {self.moe_prefetch_window}")

    def _check_hybrid_flags(self) -> None:
        object.__setattr__(self, "moe_hybrid_max_fetch", parse_max_fetch(self.moe_hybrid_max_fetch))
        inline = self.cpu_moe_inline or settings.cpu_moe_force_inline()  # shown when set by env
        object.__setattr__(self, "cpu_moe_inline", inline)
        if self.cpu_moe_threads is not None and self.cpu_moe_threads < 1:
            raise FtError(f"cpu_moe_threads must be at least 1, got {self.cpu_moe_threads}")

    def _check_cache_flags(self) -> None:
        given = [self.moe_cache_size is not None, self.moe_cache_rate is not None]
        given.append(self.moe_cache_auto)
        if sum(given) > 1:
            raise FtError(
                "give at most one of --moe-cache-size, --moe-cache-rate, --moe-cache-auto"
            )
        if any(given) and self.moe_strategy == "resident":
            raise FtError("--moe-cache-* needs an offloading --moe-strategy (not 'resident')")

    def _check_cache_fits_model(self) -> None:
        """A cache larger than the model's expert count is a mistake; say so before loading."""
        if self.moe_cache_size is None or not (Path(self.model) / "config.json").is_file():
            return
        total = ModelConfig.from_dir(self.model).total_experts
        if self.moe_cache_size > total:
            raise FtError(
                f"moe_cache_size {self.moe_cache_size} is larger than the expert count {total}"
            )

    @property
    def prefetch_depths(self) -> tuple[int, int]:
        """(at batch 1, at larger batches): the MoE layers ahead whose guessed experts offload's
        and hybrid's stops, or device gates, prefetch; (0, 0): off. "auto": AUTO_PREFETCH_DEPTH."""
        if not self.moe_prefetch:
            return (0, 0)
        if self.moe_prefetch_depth == "auto":
            return AUTO_PREFETCH_DEPTH["gates" if self.gates else "stops"]
        return (self.moe_prefetch_depth, self.moe_prefetch_depth)

    @property
    def prefetch_window(self) -> int:
        """Prefetched experts queued on the copy engine at once, the rest held on the host (0:
        every guess at once). Measured on the H200 (docs/performance.md): a window of 2 made
        offload 11-17% faster at batch 4 (level at batch 1) and hybrid's host stops 8-18% slower
        (a held guess that turns into a miss may go to its CPU). So: 2 for offload (gates or
        not) and for hybrid on gates (a miss there is the CPU's only where the split says so),
        none for hybrid's host stops."""
        if self.moe_prefetch_window is not None:
            return self.moe_prefetch_window
        if self.moe_strategy != "offload" and not self.gates:
            return 0
        return 2

    @property
    def gates(self) -> bool:
        """offload, hybrid: decode is one graph per step whose MoE layers each wait on the
        device until the host has fetched their misses (ft.engine.strategies.gated), rather
        than a host stop per layer (--no-moe-gates). On the H200 box (docs/performance.md):
        offload 3-6% ahead of host stops at batch 1 and ~7% at batch 4; hybrid 74-76% of its
        roofline against 57-63% on host stops. On the CPU, where nothing is graphed, hybrid
        keeps its host stops unless asked: there gates made the demo's hybrid runs noisier
        (its bisect named no culprit in 2 of 3 runs, against none missed on host stops)."""
        if self.moe_strategy not in ("offload", "hybrid"):
            return False
        if self.moe_strategy == "hybrid" and self.device != "cuda":
            return bool(self.moe_gates)
        return self.moe_gates is not False

    def describe(self) -> str:
        """The body of the `Resolved config:` log line."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)]
        order = ["moe_strategy", "expert_format", "device"]
        shown.sort(key=lambda s: order.index(s.split("=")[0]) if s.split("=")[0] in order else 9)
        return ", ".join(shown)


def check_prefetch_depth(depth: int | str) -> int | str:
    """-> "auto" or the depth as an int (layers a stop guesses ahead; a command line's text
    taken as one); FtError unless it is 1..MAX_PREFETCH_DEPTH or auto."""
    if isinstance(depth, str) and depth.strip().lower() == "auto":
        return "auto"
    if isinstance(depth, str) and depth.strip().isdigit():
        depth = int(depth)
    if not isinstance(depth, int) or not 1 <= depth <= MAX_PREFETCH_DEPTH:
        raise FtError(f"moe_prefetch_depth must be 1..{MAX_PREFETCH_DEPTH} or auto, got {depth!r}")
    return depth


def _checkpoint_format(model: str) -> str | None:
    """None where there is no readable config.json yet (the engine's load reports that)."""
    if not (Path(model) / "config.json").is_file():
        return None
    try:
        return ModelConfig.from_dir(model).expert_format
    except FtError:
        return None


def _resolve_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_choice("device", device, ("cpu", "cuda"))
    if device == "cuda" and not torch.cuda.is_available():
        raise FtError("device 'cuda' requested but torch sees no CUDA GPU")
    return device


def torch_dtype(name: str):
    """The torch dtype named in DTYPES ("bfloat16" -> torch.bfloat16): the one dtype table."""
    import torch

    check_choice("dtype", name, DTYPES)
    return getattr(torch, name)


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FtError(f"unknown {name} {value!r} (choose from {', '.join(allowed)})")


def parse_max_fetch(value: float | str) -> float | str:
    """--moe-hybrid-max-fetch: "auto" or a fraction F in [0, 1]."""
    if value == "auto":
        return value
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise FtError(
            f"moe_hybrid_max_fetch must be 'auto' or a number in [0, 1], got {value!r}"
        ) from None
    if not 0 <= fraction <= 1:
        raise FtError(f"moe_hybrid_max_fetch must be in [0, 1], got {fraction}")
    return fraction
