"""EngineConfig and ModelConfig check themselves: one FtError line per mistake."""

from __future__ import annotations

import pytest

from ft.engine.config import EngineConfig, ModelConfig
from ft.errors import FtError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_strategy="bogus"), "unknown moe_strategy"),
        (dict(moe_strategy="hybrid", moe_hybrid_max_fetch=1.5), "in \\[0, 1\\]"),
        (dict(moe_strategy="hybrid", moe_hybrid_max_fetch="most"), "'auto' or a number"),
        (dict(moe_strategy="hybrid", cpu_moe_threads=0), "cpu_moe_threads"),
        (dict(dtype="int3"), "unknown dtype"),
        (dict(device="tpu"), "unknown device"),
        (dict(moe_strategy="offload", moe_cache_size=0), "at least 1"),
        (dict(moe_strategy="offload", moe_cache_rate=1.5), "moe_cache_rate"),
        (dict(moe_strategy="offload", moe_cache_size=4, moe_cache_rate=0.5), "at most one"),
        (dict(moe_cache_size=4), "needs an offloading"),
        (dict(kv_reserve_tokens=-5), "at least 1"),
        (dict(gpu_memory_limit=-1.0), "positive"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(moe_strategy="offload", moe_prefetch_depth=0), "moe_prefetch_depth must be 1..4"),
        (dict(moe_strategy="offload", moe_prefetch_depth=5), "moe_prefetch_depth must be 1..4"),
        (dict(moe_strategy="offload", moe_prefetch_depth="deep"), "1..4 or auto, got 'deep'"),
        (dict(moe_strategy="offload", moe_prefetch_window=-1), "moe_prefetch_window must be 0"),
    ],
)
def test_engine_config_rejects(kwargs, message):
    with pytest.raises(FtError, match=message):
        EngineConfig(**{"model": "m", "device": "cpu", **kwargs})


def test_engine_config_defaults_resolve():
    config = EngineConfig(model="m", device="cpu")
    assert config.dtype == "float32" and config.moe_strategy == "resident"
    assert config.moe_prefetch_depth == "auto"
    assert EngineConfig(model="m", device="cpu", moe_prefetch=False).prefetch_depths == (0, 0)
    assert config.describe().startswith(
        "moe_strategy='resident', expert_format='bf16', device='cpu'"
    )


@pytest.mark.parametrize(
    "settings, depths",
    [
        (dict(moe_strategy="offload"), (3, 2)),  # device gates: 3 at batch 1
        (dict(moe_strategy="offload", moe_gates=False), (2, 2)),  # host stops
        (dict(moe_strategy="hybrid"), (2, 2)),  # on the CPU: its host stops by default
        (dict(moe_strategy="hybrid", moe_gates=True), (3, 2)),  # on gates (CUDA's default)
        (dict(moe_strategy="offload", moe_prefetch_depth="3"), (3, 3)),  # as the CLI gives it
        (dict(moe_strategy="offload", moe_prefetch_depth=1), (1, 1)),
        (dict(moe_strategy="offload", moe_prefetch=False), (0, 0)),
    ],
)
def test_prefetch_depth_auto_is_three_at_batch_1_with_device_gates_else_two(settings, depths):
    assert EngineConfig(model="m", device="cpu", **settings).prefetch_depths == depths


BASE = dict(
    vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
    num_experts_per_tok=2, intermediate_size=16,
)  # fmt: skip


MIXTRAL = {**BASE, "model_type": "mixtral", "num_local_experts": 4}


def test_qwen3_fields_and_dense_layers():
    cfg = ModelConfig.from_dict({
        **BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
        "moe_intermediate_size": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1,
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "norm_topk_prob": True,
    })  # fmt: skip
    assert cfg.moe_layers == [1, 2, 3] and cfg.rope_theta == 5e5 and cfg.head_dim == 4
    assert cfg.qk_norm and cfg.total_experts == 12 and cfg.num_kv_heads == 2


def test_mixtral_renormalises_top_k():
    cfg = ModelConfig.from_dict({**BASE, "model_type": "mixtral", "num_local_experts": 4})
    assert cfg.norm_topk_prob and not cfg.qk_norm and cfg.moe_intermediate_size == 16


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**BASE, "architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
        ({"architectures": ["MixtralForCausalLM"]}, "config.json has no field 'hidden_size'"),
        ({**MIXTRAL, "num_hidden_layers": "four"},
         "config.json field 'num_hidden_layers' should be an integer, got 'four'"),
        ({**MIXTRAL, "num_experts_per_tok": 2.5},
         "field 'num_experts_per_tok' should be an integer"),
        ({**MIXTRAL, "rms_norm_eps": [1e-6]}, "field 'rms_norm_eps' should be a number"),
        ({**MIXTRAL, "num_local_experts": None}, "config.json has no field 'num_local_experts'"),
        ({**BASE, "model_type": "mixtral", "num_local_experts": 4,
          "rope_scaling": {"rope_type": "yarn"}}, "rope_type"),
    ],
)  # fmt: skip
def test_model_config_rejects(raw, message):
    with pytest.raises(FtError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "strategy, gates, given, window",
    [
        ("offload", None, None, 2), ("offload", False, None, 2),  # gates, host stops
        ("hybrid", True, None, 2), ("hybrid", None, None, 0),  # gates, host stops
        ("offload", None, 0, 0), ("offload", False, 3, 3), ("hybrid", None, 3, 3),
    ],
)  # fmt: skip
def test_prefetch_window_is_the_strategy_s_unless_given(strategy, gates, given, window):
    config = EngineConfig(
        model="m", device="cpu", moe_strategy=strategy, moe_gates=gates,
        moe_prefetch_window=given,
    )  # fmt: skip
    assert config.prefetch_window == window
