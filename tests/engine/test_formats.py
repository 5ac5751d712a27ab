"""Expert formats (issue 8): the registry, each format's quantisation error, its layout against
the contract, the CPU executor's path against the device torch path and the reference, and
synthesized quantised checkpoints that decode the same greedy ids under every strategy."""

from __future__ import annotations

import gc
import importlib.util
import json
import shutil
import weakref

import pytest
import torch
from typer.testing import CliRunner

from ft.bench.cpu_moe import ACT_FLIPS
from ft.cli.app import app
from ft.engine.config import EXPERT_FORMATS, EngineConfig, ModelConfig
from ft.engine.cpu.layer import act_rounding, bf16_round, int_dot_tokens
from ft.engine.cpu.pool import CpuMoeExecutor, expert_jobs
from ft.engine.experts.grouped import blocks_on_device, moe_pairs, reduce_pairs, ref_moe_pairs
from ft.engine.experts.store import HostExpertStore
from ft.engine.formats import FORMATS, format_of
from ft.engine.formats.fp8_block import BLOCK, E4M3
from ft.engine.formats.nvfp4 import GROUP
from ft.engine.model.loader import CheckpointReader, load_dense, load_experts
from ft.engine.runner import LLMEngine, SamplingParams
from ft.engine.synth.checkpoint import synth_checkpoint
from ft.errors import FtError
from tests.engine import quant_ref
from tests.engine.interpreter import run_interpreted
from tests.engine.test_auto import SEED, SMALL, lines, start
from tests.engine.test_runner import PROMPTS, run_all

QUANTIZED = ("int8", "fp8_block", "nvfp4")
E, D, INTER = 6, 256, 160  # 160: fp8's second block of I is partial, nvfp4's groups whole
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def float_experts(seed: int = 0, experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * INTER, D, generator=gen) / D**0.5
    w2 = torch.randn(experts, D, INTER, generator=gen) / INTER**0.5
    return w13, w2


# -- the registry ---------------------------------------------------------------------------------


def test_registry_lists_the_engine_formats():
    assert tuple(FORMATS) == EXPERT_FORMATS == ("bf16", "int8", "fp8_block", "nvfp4")
    assert all(f.cpu_path for f in FORMATS.values())  # each dequantises a block on the CPU


@pytest.mark.parametrize(
    "fmt, qwen3_30b, seed_next",  # bytes per expert, worked out by hand from the contract
    [
        ("bf16", 3 * 2048 * 768 * 2, 3 * 2560 * 640 * 2),
        ("int8", 4_718_592 + 4 * (2 * 768 + 2048), 4_915_200 + 4 * (2 * 640 + 2560)),
        ("fp8_block", 4_718_592 + 4 * (12 * 16 + 16 * 6), 4_915_200 + 4 * (10 * 20 + 20 * 5)),
        ("nvfp4", 2_359_296 + 294_912 + 4 * 3, 2_457_600 + 307_200 + 4 * 3),
    ],
)
def test_bytes_per_expert(fmt, qwen3_30b, seed_next):
    form = FORMATS[fmt]
    assert form.expert_bytes(2048, 768, torch.bfloat16) == qwen3_30b
    assert form.expert_bytes(2560, 640, torch.bfloat16) == seed_next


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_quantized_parts_have_the_declared_shapes(fmt):
    form = FORMATS[fmt]
    parts = form.quantize(*float_experts())
    spec = form.parts(D, INTER, torch.float32)
    assert list(parts) == list(spec)
    for name, p in spec.items():
        assert (tuple(parts[name].shape), parts[name].dtype) == ((E, *p.shape), p.dtype), name


# -- quantisation error ---------------------------------------------------------------------------


def int8_bound(parts, w13, w2):
    return parts["w13_scale"][..., None] / 2, parts["w2_scale"][..., None] / 2  # half a step


def fp8_bound(parts, w13, w2):
    """e4m3 keeps 3 mantissa bits: half a step is <= 2^-4 of the value, or 2^-10 of the block
    scale below the normal range."""
    rows = torch.arange(2 * INTER)
    nb = -(-INTER // BLOCK)
    scale13 = parts["w13_scale"][:, (rows // INTER) * nb + (rows % INTER) // BLOCK]
    scale13 = scale13[..., torch.arange(D) // BLOCK]  # [E, 2I, D]
    scale2 = parts["w2_scale"][:, torch.arange(D) // BLOCK][..., torch.arange(INTER) // BLOCK]
    return (
        torch.maximum(w13.abs() / 16, scale13 / 1024),
        torch.maximum(w2.abs() / 16, scale2 / 1024),
    )


def nvfp4_bound(parts, w13, w2):
    """Half the e2m1 step at the value's magnitude (0.5 below 2, 1 below 4, 2 above) times the
    group's scale, or what clipping at 6 loses (the e4m3 block scale was rounded down); all of
    it where the group's scale is 0 (an all-zero group)."""

    def bound(w, scale, scale_2):
        step = scale.float().repeat_interleave(GROUP, -1) * scale_2  # what a code of 1 is worth
        v = w.abs() / step
        half = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
        return torch.where(step > 0, step * torch.maximum(half, v - 6), w.abs())

    gate_up = parts["w13_scale_2"].repeat_interleave(INTER, -1)[..., None]  # [E, 2I, 1]
    return (
        bound(w13, parts["w13_scale"], gate_up),
        bound(w2, parts["w2_scale"], parts["w2_scale_2"][..., None]),  # [E, 1, 1]
    )


BOUNDS = {"int8": int8_bound, "fp8_block": fp8_bound, "nvfp4": nvfp4_bound}


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantized_weights_are_within_the_format_error(fmt):
    form = FORMATS[fmt]
    w13, w2 = float_experts(seed=1)
    w13[0, 3] = 0.0  # an all-zero row (and, for nvfp4, groups) must stay zero
    parts = form.quantize(w13, w2)
    got13, got2 = form.dequantize(parts, torch.float32)
    bound13, bound2 = BOUNDS[fmt](parts, w13, w2)
    slack = 1e-5  # float32 arithmetic: w / scale may land on a rounding tie
    assert ((got13 - w13).abs() <= bound13 * (1 + slack) + 1e-12).all()
    assert ((got2 - w2).abs() <= bound2 * (1 + slack) + 1e-12).all()
    assert torch.equal(got13[0, 3], torch.zeros(D))
    rel = (got13 - w13).norm() / w13.norm()
    assert 0 < rel < {"int8": 0.02, "fp8_block": 0.05, "nvfp4": 0.15}[fmt]


def test_nvfp4_layout_is_the_contract():
    """Element 2j in the low nibble, e2m1 values, e4m3 scale per 16, gate/up global scales."""
    form, inter, hidden = FORMATS["nvfp4"], 16, 32
    codes = torch.tensor([0x21, 0xF9] + [0] * 14, dtype=torch.uint8)  # 0.5, 1.0, -0.5, -6.0
    parts = {
        "w13": codes.repeat(2 * inter, 1),
        "w13_scale": torch.full((2 * inter, hidden // GROUP), 2.0).to(E4M3),
        "w13_scale_2": torch.tensor([1.0, 10.0]),
        "w2": torch.zeros(hidden, inter // 2, dtype=torch.uint8),
        "w2_scale": torch.ones(hidden, inter // GROUP).to(E4M3),
        "w2_scale_2": torch.tensor([1.0]),
    }
    w13, _ = form.dequantize(parts, torch.float32)
    assert w13[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]  # x block scale 2, gate's scale_2 1
    assert w13[inter, :4].tolist() == [10.0, 20.0, -10.0, -120.0]  # up's scale_2 10


def test_fp8_block_scales_gate_and_up_apart():
    """Row r of w13 reads block row (r // I) * ceil(I/128) + (r % I) // 128."""
    form = FORMATS["fp8_block"]
    parts = form.quantize(*float_experts(experts=1))
    parts["w13"] = torch.ones_like(parts["w13"].float()).to(E4M3)
    parts["w13_scale"] = torch.arange(4.0)[None, :, None].expand(1, 4, 2).contiguous()
    w13, _ = form.dequantize(parts, torch.float32)
    rows = [0, 127, 128, INTER - 1, INTER, INTER + 128, 2 * INTER - 1]
    assert [w13[0, r, 0].item() for r in rows] == [0, 0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_a_block_of_rows_is_a_slice_of_the_whole(fmt):
    form = FORMATS[fmt]
    parts = {k: v[2] for k, v in form.quantize(*float_experts()).items()}
    w13, w2 = form.dequantize(parts, torch.float32)
    for lo, hi in ((0, INTER), (16, 48), (128, 160)):
        s = hi - lo
        gu, down = torch.empty(2 * s, D), torch.empty(D, s)
        form.dequant_block(parts, lo, hi, gu, down)
        assert torch.equal(gu[:s], w13[lo:hi]) and torch.equal(gu[s:], w13[INTER + lo : INTER + hi])
        assert torch.equal(down, w2[:, lo:hi])


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_cpu_kernels_multiply_the_codes_as_the_dequantised_weights(fmt):
    """rows_dot over row ranges of w13 (gate's, up's, across the two) and column ranges of w2,
    at offsets inside and across scale groups, equals x @ the dequantised block."""
    form = FORMATS[fmt]
    parts = {k: v[1] for k, v in form.quantize(*float_experts(seed=4)).items()}
    w13, w2 = form.dequantize(parts, torch.float32)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(9))
    for r0, r1 in ((0, INTER), (16, 48), (INTER - 16, INTER + 32)):
        out = torch.empty(3, r1 - r0)
        form.rows_dot(parts, "w13", r0, r1, 0, x.numpy(), out.numpy())
        torch.testing.assert_close(out, x @ w13[r0:r1].T, rtol=1e-5, atol=1e-5)
    for c0, c1 in ((0, INTER), (16, 48), (112, 160)):  # 112..160 crosses fp8's 128-block edge
        act = torch.randn(3, c1 - c0, generator=torch.Generator().manual_seed(c0))
        out = torch.empty(3, D)
        form.rows_dot(parts, "w2", 0, D, c0, act.numpy(), out.numpy())
        torch.testing.assert_close(out, act @ w2[:, c0:c1].T, rtol=1e-5, atol=1e-5)


# -- the CPU executor's path against the device torch path ---------------------------------------


def routed(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(tokens)])  # [T, K]
    return x, ids, torch.rand(tokens, 3, generator=gen)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_cpu_executor_equals_device_path_and_reference(fmt, tokens):
    form = FORMATS[fmt]
    bank = form.quantize(*float_experts(seed=2))
    x, ids, weights = routed(tokens, seed=tokens)
    blocks = blocks_on_device(ids, weights)  # slot = expert id, as resident
    device = reduce_pairs(blocks, moe_pairs(x, bank, blocks, "torch", fmt), tokens)
    tok = torch.arange(tokens).repeat_interleave(3)
    ref = ref_moe_pairs(x, bank, tok, ids.flatten(), weights.flatten(), fmt)
    jobs = expert_jobs(bank, ids, weights, list(range(E)), fmt)
    with CpuMoeExecutor(threads=2, min_slice=1, tasks_per_thread=4) as pool:  # many blocks of I
        cpu = pool.submit(x, jobs).wait()
        assert pool.stats.experts_in_pool == len(jobs)
    torch.testing.assert_close(device, ref, rtol=1e-5, atol=1e-5)
    int_dot = int_dot_tokens(fmt, bank["w13"].dtype)
    bf16_dot = act_rounding(fmt, bank["w13"].dtype, 64) is bf16_round
    if int_dot or bf16_dot:  # the pool's integer dot (experts of one token: int8, nvfp4 on
        # AVX2) or bf16 dot (AVX512-BF16): its rounding modelled
        w13, w2 = quant_ref.dequantize(bank, fmt)
        ref = quant_ref.moe_reference(x, w13, w2, ids, weights, int_dot_tokens=int_dot,
                                      bf16_dot=bf16_dot)  # fmt: skip
        flips = ACT_FLIPS * quant_ref.act_flip(x, w13, w2, ids, weights)  # (test_cpu_layer)
        torch.testing.assert_close(cpu, ref, rtol=1e-5, atol=1e-5 + flips)
        return
    torch.testing.assert_close(cpu, ref, rtol=1e-5, atol=1e-5)


def test_a_part_of_the_wrong_shape_is_refused_not_read_out_of_bounds():
    """The compiled kernels do not check bounds: the parts are checked first (the layer
    kernel's at submit; the task path's in the worker, handed to wait())."""
    bank = FORMATS["nvfp4"].quantize(*float_experts(seed=5))
    bank["w13_scale"] = bank["w13_scale"][:, :, :-1]  # one 16-group short per row
    x, ids, weights = routed(2, seed=3)
    jobs = expert_jobs(bank, ids, weights, list(range(E)), "nvfp4")
    with CpuMoeExecutor(threads=2) as pool:
        with pytest.raises(ValueError, match="w13_scale"):
            pool.submit(x, jobs)
    with CpuMoeExecutor(threads=2, compute="native") as pool:
        with pytest.raises(RuntimeError, match="worker failed") as failed:
            pool.submit(x, jobs).wait(timeout=30)
    assert "w13_scale" in str(failed.value.__cause__)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_routed_submit_is_the_submit_of_its_jobs(fmt, tokens):
    """submit_routed builds the layer kernel's plan from the bank's addresses and the routing in
    array operations: the same call, bit for bit, as the jobs expert_jobs makes, experts no
    token reaches left out (and not counted)."""
    bank = FORMATS[fmt].quantize(*float_experts(seed=4))
    if fmt == "bf16":
        bank = {k: t.bfloat16() for k, t in bank.items()}
    x, ids, weights = routed(tokens, seed=11 + tokens)
    experts = [4, 0, 5, 1, 2, 3]  # any order; with 1 token, 3 of them get none
    with CpuMoeExecutor(threads=2) as pool:
        jobs = expert_jobs(bank, ids, weights, experts, fmt)
        want = pool.submit(x, jobs).wait()
        got = pool.submit_routed(x, bank, fmt, ids, weights, experts).wait()
        assert torch.equal(got, want)
        assert pool.stats.experts_in_pool == 2 * len(jobs)
        one = pool.submit_routed(x, bank, fmt, ids, weights, [int(ids[0, 1])]).wait()
        only = [j for j in jobs if j.parts["w13"].data_ptr() == bank["w13"][ids[0, 1]].data_ptr()]
        assert torch.equal(one, pool.submit(x, only).wait())


def test_a_routed_submit_reads_x_and_the_routing_as_they_come():
    """The call's plan copies x as float32 from bf16 (hybrid's x, as the device holds it) or
    float32, strided or not, and reads routing of any int and float dtype: each the same call."""
    bank = {k: t.bfloat16() for k, t in FORMATS["bf16"].quantize(*float_experts(seed=7)).items()}
    x, ids, weights = routed(3, seed=8)
    xb, weights = x.bfloat16(), weights.bfloat16().float()  # each dtype below holds them
    with CpuMoeExecutor(threads=2) as pool:
        want = pool.submit_routed(xb.float(), bank, "bf16", ids, weights, [0, 1, 2, 3]).wait()
        for x_in, ids_in, weights_in in [
            (xb, ids, weights),
            (xb.t().contiguous().t(), ids.int(), weights.bfloat16()),
            (xb.float().t().contiguous().t(), ids.t().contiguous().t(), weights.double()),
        ]:  # fmt: skip
            assert not x_in.is_contiguous() or x_in.dtype == torch.bfloat16
            got = pool.submit_routed(x_in, bank, "bf16", ids_in, weights_in, [0, 1, 2, 3]).wait()
            assert torch.equal(got, want)


def test_a_routed_submit_refuses_what_the_kernel_cannot_read():
    """The kernel reads raw addresses: the bank, the experts and the routing are checked in the
    caller, and a bank changed after a good call is checked again."""
    bank = FORMATS["int8"].quantize(*float_experts(seed=6))
    x, ids, weights = routed(2, seed=5)
    with CpuMoeExecutor(threads=2) as pool:
        pool.submit_routed(x, bank, "int8", ids, weights, [0, 1]).wait()
        with pytest.raises(ValueError, match=r"experts must lie in \[0, 6\)"):
            pool.submit_routed(x, bank, "int8", ids, weights, [6])
        with pytest.raises(ValueError, match="does not match x"):
            pool.submit_routed(x[:1], bank, "int8", ids, weights, [0])
        with pytest.raises(ValueError, match="does not match x"):
            pool.submit_routed(x, bank, "int8", ids[:, :1], weights, [0])
        with pytest.raises(ValueError, match="does not match x"):
            pool.submit_routed(x, bank, "int8", ids.flatten(), weights.flatten(), [0])
        with pytest.raises(ValueError, match="w13"):  # x's width is not the bank's
            pool.submit_routed(x[:, :-32], bank, "int8", ids, weights, [0])
        with pytest.raises(ValueError, match="an expert is given twice"):
            pool.submit_routed(x, bank, "int8", ids, weights, [0, 1, 0])
        unrouted = next(e for e in range(E) if e not in ids.flatten().tolist())
        with pytest.raises(ValueError, match="no token is routed"):
            pool.submit_routed(x, bank, "int8", ids, weights, [unrouted])
        short = {**bank, "w2_scale": bank["w2_scale"][:, :-1]}
        with pytest.raises(ValueError, match="w2_scale"):
            pool.submit_routed(x, short, "int8", ids, weights, [0])
        strided = {**bank, "w13": bank["w13"].transpose(1, 2).contiguous().transpose(1, 2)}
        with pytest.raises(ValueError, match="w13: want \\[6, ...\\] of contiguous experts"):
            pool.submit_routed(x, strided, "int8", ids, weights, [0])
        # experts apart in memory (a store that packs each expert's parts together) are read
        apart = {k: torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0] for k, t in bank.items()}
        assert not apart["w13"].is_contiguous()
        from_apart = pool.submit_routed(x, apart, "int8", ids, weights, [0, 1]).wait()
        out = pool.submit_routed(x, bank, "int8", ids, weights, [0, 1]).wait()  # still serves
        assert torch.equal(from_apart, out) and pool.alive


def test_a_routed_call_keeps_the_bank_it_reads_alive_until_it_is_done():
    """The workers read the bank by address: a caller that drops it mid-call frees nothing."""
    bank = FORMATS["int8"].quantize(*float_experts(seed=8))
    x, ids, weights = routed(2, seed=9)
    experts = ids.unique().tolist()
    with CpuMoeExecutor(threads=2) as pool:
        want = pool.submit_routed(x, bank, "int8", ids, weights, experts).wait()
        part = weakref.ref(bank["w13"])
        handle = pool.submit_routed(x, bank, "int8", ids, weights, experts)
        del bank
        gc.collect()
        assert part() is not None
        assert torch.equal(handle.wait(), want)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_cpu_executor_with_bf16_activations(fmt):
    """A bf16 engine: the codes are multiplied in float32 all the same (x rounded to bf16)."""
    form = FORMATS[fmt]
    bank = form.quantize(*float_experts(seed=3))
    x, ids, weights = routed(3, seed=7)
    tok = torch.arange(3).repeat_interleave(3)
    ref = ref_moe_pairs(x, bank, tok, ids.flatten(), weights.flatten(), fmt)
    jobs = expert_jobs(bank, ids, weights, list(range(E)), fmt)
    with CpuMoeExecutor(threads=2, min_slice=16) as pool:
        cpu = pool.submit(x.bfloat16(), jobs).wait()
    torch.testing.assert_close(cpu, ref, rtol=5e-2, atol=5e-2)


def test_nvfp4_cpu_blocks_are_cut_on_its_groups():
    from ft.engine.cpu.pool import split_range

    blocks = split_range(INTER, 7, 1, align=GROUP)
    assert blocks[0][0] == 0 and blocks[-1][1] == INTER and len(blocks) == 7
    assert all(lo % GROUP == 0 and hi % GROUP == 0 for lo, hi in blocks)


# -- synthesized quantised checkpoints -------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    for fmt in QUANTIZED:  # float32 dense weights: the CPU strategies then agree exactly
        synth_checkpoint("tiny", root / fmt, layers=2, dtype="float32", seed=1, expert_format=fmt)
    return root


def engine_for(model_dir, strategy: str, **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=4,
                          moe_strategy=strategy, **kw)  # fmt: skip
    return LLMEngine(config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_synthesized_checkpoint_decodes_the_same_under_every_strategy(quantized_tiny, fmt):
    model_dir = quantized_tiny / fmt
    runs = {
        "resident": {},
        "offload": dict(moe_cache_size=4),
        "hybrid": dict(moe_cache_size=4, moe_hybrid_max_fetch=0.3, cpu_moe_threads=2),
    }
    got, stats = {}, {}
    for strategy, kw in runs.items():
        engine = engine_for(model_dir, strategy, **kw)
        try:
            assert engine.config.expert_format == fmt and engine.strategy.store.fmt == fmt
            got[strategy], stats[strategy] = run_all(engine, PROMPTS, GREEDY), engine.stats
            expert_bytes = engine.strategy.store.expert_bytes
        finally:
            engine.close()
    assert got["offload"] == got["resident"] and got["hybrid"] == got["resident"]
    assert expert_bytes == FORMATS[fmt].expert_bytes(64, 32)
    assert stats["hybrid"].experts_cpu > 0 and stats["hybrid"].experts_fetched > 0
    crossed = stats["offload"].experts_fetched + stats["offload"].experts_in_place
    assert stats["offload"].bytes_fetched == crossed * expert_bytes


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_synthesized_checkpoint_uses_the_public_names(quantized_tiny, fmt):
    from safetensors import safe_open

    model_dir = quantized_tiny / fmt
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"] == FORMATS[fmt].quantization_config()
    assert ModelConfig.from_dir(model_dir).expert_format == fmt
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    base = "model.layers.1.mlp.experts.15.up_proj"
    want = {  # name -> (dtype, shape) for up_proj [I=32, D=64]
        "int8": {"weight": (torch.int8, (32, 64)), "weight_scale": (torch.float32, (32, 1))},
        "fp8_block": {"weight": (E4M3, (32, 64)), "weight_scale_inv": (torch.float32, (1, 1))},
        "nvfp4": {"weight": (torch.uint8, (32, 32)), "weight_scale": (E4M3, (32, 4)),
                  "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())},
    }[fmt]  # fmt: skip
    assert {n for n in index if n.startswith(base + ".")} == {f"{base}.{s}" for s in want}
    for suffix, (dtype, shape) in want.items():
        name = f"{base}.{suffix}"
        with safe_open(str(model_dir / index[name]), "pt") as f:
            t = f.get_tensor(name)
        assert (t.dtype, tuple(t.shape)) == (dtype, shape), name
    assert index["model.layers.0.self_attn.q_proj.weight"]  # dense weights: float, as before


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_the_loader_stacks_gate_over_up_as_the_contract_says(quantized_tiny, fmt):
    from safetensors import safe_open

    model_dir, form = quantized_tiny / fmt, FORMATS[fmt]
    cfg = ModelConfig.from_dir(model_dir)
    store = load_experts(CheckpointReader(model_dir), cfg, torch.float32)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]

    def read(proj: str, suffix: str) -> torch.Tensor:
        name = f"model.layers.1.mlp.experts.7.{proj}.{suffix}"
        with safe_open(str(model_dir / index[name]), "pt") as f:
            return f.get_tensor(name)

    expert = store.expert(1, 7)
    for suffix, part in form.tensors.items():
        gate, up, down = (read(p, suffix) for p in ("gate_proj", "up_proj", "down_proj"))
        half = expert["w13" + part].shape[0] // 2  # [I, ...], or [1] of a scalar scale_2
        stacked = torch.cat((gate.reshape(half, -1), up.reshape(half, -1)))
        assert torch.equal(expert["w13" + part].reshape(2 * half, -1).view(torch.uint8),
                           stacked.view(torch.uint8)), suffix  # fmt: skip
        assert torch.equal(expert["w2" + part].flatten().view(torch.uint8),
                           down.flatten().view(torch.uint8)), suffix  # fmt: skip


def rewrite(model_dir, name: str, tensor: torch.Tensor) -> None:
    """Replace (or add, beside the embedding) one tensor of a sharded checkpoint."""
    from safetensors.torch import load_file, save_file

    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].setdefault(name, index["weight_map"]["model.embed_tokens.weight"])
    tensors = load_file(str(model_dir / shard))
    tensors[name] = tensor
    save_file(tensors, str(model_dir / shard), {"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_a_scale_of_the_wrong_shape_is_one_line_naming_it(quantized_tiny, tmp_path):
    model_dir = shutil.copytree(quantized_tiny / "nvfp4", tmp_path / "bad")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    rewrite(model_dir, name, torch.ones(64, 3).to(E4M3))  # [D, I/16] is (64, 2)
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(FtError, match=rf"^{name} has shape \(64, 3\), expected \(64, 2\)$"):
        load_experts(CheckpointReader(model_dir), cfg, torch.float32)
    result = CliRunner().invoke(
        app, ["generate", "--model", str(model_dir), "--prompt-ids", "1,2", "--max-tokens", "1"]
    )
    assert result.exit_code == 1 and f"error: {name} has shape" in result.output
    assert "Traceback" not in result.output


def test_quantized_dense_projections_are_refused(quantized_tiny, tmp_path):
    model_dir = shutil.copytree(quantized_tiny / "fp8_block", tmp_path / "dense")
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    rewrite(model_dir, name, torch.ones(1, 1))
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(FtError, match=f"{name}: quantised dense projections are not supported"):
        load_dense(CheckpointReader(model_dir), cfg, "cpu", torch.float32)


@pytest.mark.timeout(120)
def test_bench_decode_counts_the_format_bytes(quantized_tiny):
    model_dir = quantized_tiny / "nvfp4"
    args = ["bench", "decode", "--json", "--model", str(model_dir), "--strategies", "offload",
            "--tokens", "2", "--warmup", "1", "--moe-cache-rate", "0.25"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    (row,) = report["results"]
    assert report["expert_format"] == "nvfp4" and row["error"] is None
    step = row["per_step"]
    assert step["expert_bytes"] == FORMATS["nvfp4"].expert_bytes(64, 32)
    assert step["pcie_bytes"] == pytest.approx(step["experts_fetched"] * step["expert_bytes"])


def test_expert_format_comes_from_the_checkpoint(quantized_tiny):
    model = str(quantized_tiny / "nvfp4")
    config = EngineConfig(model=model, device="cpu")
    assert config.expert_format == "nvfp4" and "expert_format='nvfp4'" in config.describe()
    assert EngineConfig(model=model, device="cpu", expert_format="nvfp4").expert_format == "nvfp4"
    with pytest.raises(FtError, match="^--expert-format int8 disagrees with the checkpoint"):
        EngineConfig(model=model, device="cpu", expert_format="int8")
    with pytest.raises(FtError, match="unknown expert_format 'nvfp5'"):
        EngineConfig(model=model, device="cpu", expert_format="nvfp5")
    assert EngineConfig(model="nowhere", device="cpu").expert_format == "bf16"


def test_quantization_configs_name_their_format():
    for fmt, form in FORMATS.items():
        assert format_of(form.quantization_config()) == fmt
    assert format_of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == "fp8_block"
    with pytest.raises(FtError, match="unsupported quantization_config .quant_method 'gptq'"):
        format_of({"quant_method": "gptq", "bits": 4})
    with pytest.raises(FtError, match="unsupported"):
        format_of({"quant_method": "fp8"})  # per-tensor fp8: not block-scaled


def test_nvfp4_needs_multiples_of_16():
    with pytest.raises(FtError, match="multiples of 16, got hidden 60, intermediate 32"):
        HostExpertStore.allocate(1, [0], 4, 60, 32, torch.float32, "nvfp4")


def test_auto_reads_the_profile_entry_of_the_checkpoint_format(quantized_tiny, ft_log):
    """The seed's profile: nvfp4 says hybrid (ratio 2.29); fp8_block offload, with its note."""
    kw = dict(moe_strategy="auto", gpu_memory_limit=SMALL, moe_cache_rate=0.25)
    engine = start(quantized_tiny / "nvfp4", bw_profile=str(SEED), **kw)
    assert engine.config.moe_strategy == "hybrid"
    assert "nvfp4 ratio 2.29 >= 2.0" in lines(ft_log, "--moe-strategy auto resolved")[0]
    assert "fmt=nvfp4 " in lines(ft_log, "CPU MoE executor ready")[0]
    engine = start(quantized_tiny / "fp8_block", bw_profile=str(SEED), **kw)
    assert engine.config.moe_strategy == "offload"
    line = lines(ft_log, "--moe-strategy auto resolved offload")[0]
    assert "fp8_block: CPU MoE has no fp8_block weight path; hybrid unavailable" in line


def test_cli_synth_unknown_format_is_one_line(tmp_path):
    args = ["--preset", "tiny", "--out", str(tmp_path / "x"), "--expert-format", "nvfp5"]
    bad = CliRunner().invoke(app, ["model", "synth", *args])
    assert bad.exit_code == 1 and "unknown expert format 'nvfp5'" in bad.output
    assert not (tmp_path / "x").exists()


# -- Triton: the kernels read each format's bank as the engine's formats quantise it ------------


_INTERPRETED = """
import torch
from ft.engine.experts.grouped import blocks_on_device, reduce_pairs, ref_moe_pairs
from ft.engine.kernels.moe import triton_moe_pairs
from ft.engine.formats import FORMATS
from tests.engine.test_formats import E, float_experts, routed
for fmt, form in FORMATS.items():
    bank = form.quantize(*float_experts(seed=4))
    x, ids, weights = routed(3, seed=5)
    blocks = blocks_on_device(ids, weights)
    got = reduce_pairs(blocks, triton_moe_pairs(x, bank, blocks, fmt), 3)
    tok = torch.arange(3).repeat_interleave(3)
    ref = ref_moe_pairs(x, bank, tok, ids.flatten(), weights.flatten(), fmt)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.timeout(600)
def test_triton_formats_match_reference_under_the_interpreter():
    proc = run_interpreted(_INTERPRETED, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
