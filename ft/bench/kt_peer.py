"""`ft bench cpu-moe --peer kt`: KTransformers' CPU MoE kernels (kt-kernel) as the peer of the
pool, through their lowest-level entry point: `CPUInfer`, a MoE object built from a `MOEConfig`
of per-expert weight pointers into our store, `load_weights_task`, then per call
`CPUInfer.submit(moe.forward_task(...))` + `sync()` (what kt's own wrappers do,
kt_kernel/utils/amx.py `NativeMoEWrapper.load_weights`).

Only kt's compiled extension is loaded, not its Python package: `import kt_kernel` imports its
checkpoint loaders, which need gguf and more that `pip install --no-deps` leaves out. The
extension is picked by kt's own CPU detection (kt_kernel/_cpu_detect.py, run from its file).

Pairs (ft format -> kt method, its classes in kt's order of preference):
- bf16 -> BF16: AMXBF16_MOE, else AVX2BF16_MOE; reads our bf16 gate, up and down.
- int8 -> AMXINT8: AMXInt8_MOE only (no AVX2 build has it); kt quantises it from bf16 itself,
  so it is not fed from an int8 store here: "no path".
- fp8_block -> FP8: AMXFP8_MOE, else AVX2FP8_MOE; reads our e4m3 and float32 128x128 scales.
- nvfp4 -> NVFP4: AVX2MXFP4_MOE (kt's only group-16 FP4 kernel); reads our e2m1 codes and, as
  kt's NVFP4 loader does, one bf16 scale per 16 = e4m3 scale x the tensor's global scale.
kt holds what it loads in its own buffers (docs/cpu-pool.md, "Beside kt-kernel").
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import Tensor

from ft.bench.bw_formats import BenchFormat
from ft.engine.formats import Parts
from ft.engine.formats.nvfp4 import BYTE_PAIRS, GROUP
from ft.errors import FtError

KT_VERSION = "0.7.2"  # the version measured; others are loaded and reported as they are
INSTALL = (
    f"--peer kt needs kt-kernel: pip install --no-deps kt-kernel=={KT_VERSION} (--no-deps: its "
    "metadata pins torch==2.9.1, which pip would install over this torch; its kernels do not "
    "link torch)"
)
FP8_BLOCK = 128
# ft format -> (kt's method name, its classes in kt's order of preference)
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bf16": ("BF16", ("AMXBF16_MOE", "AVX2BF16_MOE")),
    "int8": ("AMXINT8", ("AMXInt8_MOE",)),
    "fp8_block": ("FP8", ("AMXFP8_MOE", "AVX2FP8_MOE")),
    "nvfp4": ("NVFP4", ("AVX2MXFP4_MOE",)),
}


def load_extension():
    """-> (kt's extension module for this CPU, its variant, kt-kernel's version); FtError with
    the install line where kt-kernel is not installed or its extension does not load."""
    try:
        spec = importlib.util.find_spec("kt_kernel")  # finds the package without running it
    except ImportError:
        spec = None
    if spec is None or not spec.origin:
        raise FtError(INSTALL)
    detect_py = Path(spec.origin).parent / "_cpu_detect.py"
    try:
        detect_spec = importlib.util.spec_from_file_location("_kt_cpu_detect", detect_py)
        detect = importlib.util.module_from_spec(detect_spec)
        detect_spec.loader.exec_module(detect)
        ext, variant = detect.initialize()
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FtError(f"kt-kernel's extension did not load ({first}); {INSTALL}") from None
    try:
        kt_version = version("kt-kernel")
    except PackageNotFoundError:
        kt_version = "unknown"
    return ext, variant, kt_version


@contextlib.contextmanager
def stdout_to_stderr():
    """kt's C++ prints to fd 1 when it starts, builds a layer and stops: send it to stderr, so
    that `--json` keeps stdout to itself. C's buffer is flushed before fd 1 comes back."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def host_rss() -> int:
    """This process's resident bytes (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class KtPeer:
    """The `kt` peer: one CPUInfer of `threads` workers for the run, one kt layer per format."""

    name = "kt"

    def __init__(self) -> None:
        self.ext, self.variant, self.version = load_extension()
        self.cpu = None

    def start(self, threads: int) -> None:
        with stdout_to_stderr():
            self.cpu = self.ext.CPUInfer(threads)

    def close(self) -> None:
        with stdout_to_stderr():
            self.cpu = None  # its destructor stops the workers (and prints)

    def describe(self) -> dict:
        return dict(name=self.name, version=self.version, variant=self.variant,
                    classes=sorted(n for n in dir(self.ext.moe) if n.endswith("MOE")))  # fmt: skip

    def layer(self, fmt: BenchFormat, bank: Parts, count: int, max_tokens: int, max_k: int):
        """-> a KtLayer over the store's `count` experts, for calls of up to `max_tokens` tokens
        and `max_k` experts (kt's buffers: a larger call computes garbage), or a "no path: ..."
        note."""
        if fmt.name not in METHODS or fmt.dtype != torch.bfloat16:
            return f"no path: kt has no {fmt.name} experts"
        method, classes = METHODS[fmt.name]
        found = [c for c in classes if hasattr(self.ext.moe, c)]
        if not found:
            names = "/".join(classes)
            return f"no path: kt's {method} ({names}) is not in its {self.variant} build"
        if fmt.name == "int8":
            return f"no path: kt's {method} quantises bf16 itself; it does not read int8 experts"
        return KtLayer(self, fmt, bank, count, (max_tokens, max_k), found[0])


class KtLayer:
    """One kt MoE layer over the store's experts, loaded (copied) by kt at construction."""

    name = "kt"

    def __init__(self, peer: KtPeer, fmt: BenchFormat, bank: Parts, count: int,
                 most: tuple[int, int], cls_name: str) -> None:  # fmt: skip
        hidden, inter = bank["w2"].shape[-2], bank["w13"].shape[-2] // 2
        self.peer, self.fmt, self.bank, self.method, self.most = peer, fmt, bank, cls_name, most
        self.scales = _kt_scales(fmt.name, bank, inter)  # part -> [E, ...] as kt reads them
        self.expert_bytes = _kt_expert_bytes(fmt.name, hidden, inter)
        self.mask = torch.zeros(count, dtype=torch.bool)  # no expert on the GPU
        cfg = peer.ext.moe.MOEConfig(count, most[1], hidden, inter, self.mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, peer.cpu.backend_, most[0]
        _point(cfg, fmt.name, bank, self.scales, count, inter)
        before = host_rss()
        with stdout_to_stderr():
            self.moe = getattr(peer.ext.moe, cls_name)(cfg)
            order = torch.arange(count, dtype=torch.int64)  # physical -> logical: the same
            peer.cpu.submit(self.moe.load_weights_task(order.data_ptr()))
            peer.cpu.sync()
        self.host_bytes = host_rss() - before

    def weights(self, expert: int) -> tuple[Tensor, Tensor]:
        """(w13 [2I, D], w2 [D, I]) float32, as kt holds them: ours, but nvfp4's scales
        folded to bf16."""
        parts = {k: v[expert] for k, v in self.bank.items()}
        if self.fmt.name != "nvfp4":
            return self.fmt.form.dequantize(parts, torch.float32)
        s13, s2 = self.scales["w13_scale"][expert], self.scales["w2_scale"][expert]
        return _fp4(parts["w13"], s13), _fp4(parts["w2"], s2)

    def call(self, x: Tensor, experts: list[int], weight: float) -> Callable[[], Tensor]:
        """One forward, prepared: every token of x [T, D] to every expert, router weight
        `weight` each; calling it submits and syncs, -> out [T, D] bf16."""
        tokens, k = x.shape[0], len(experts)
        if tokens > self.most[0] or k > self.most[1]:  # kt sizes its buffers by these
            raise ValueError(f"kt layer built for {self.most} (tokens, experts), got {tokens, k}")
        ids = torch.tensor(experts, dtype=torch.int64).repeat(tokens, 1)  # [T, k]
        weights = torch.full((tokens, k), weight, dtype=torch.float32)
        out = torch.empty(tokens, x.shape[1], dtype=torch.bfloat16)
        x = x.to(torch.bfloat16).contiguous()
        bsz = torch.tensor([tokens], dtype=torch.int32)

        def run() -> Tensor:  # looks kt up when called: no reference outlives close()
            self.peer.cpu.submit(self.moe.forward_task(
                bsz.data_ptr(), k, ids.data_ptr(), weights.data_ptr(), x.data_ptr(),
                out.data_ptr(), False))  # fmt: skip
            self.peer.cpu.sync()
            return out

        return run

    def close(self) -> None:
        with stdout_to_stderr():
            self.moe = None


def _point(cfg, fmt: str, bank: Parts, scales: Parts, count: int, inter: int) -> None:
    """Per-expert pointers (one NUMA pool): gate = w13's first I rows, up = the next I, down =
    w2; scales alike (fp8: 128-row blocks of gate, then of up). BF16 passes no scales."""
    gate_scale_rows = -(-inter // FP8_BLOCK) if fmt == "fp8_block" else inter
    experts = range(count)
    cfg.gate_projs = [[bank["w13"][e, :inter].data_ptr() for e in experts]]
    cfg.up_projs = [[bank["w13"][e, inter:].data_ptr() for e in experts]]
    cfg.down_projs = [[bank["w2"][e].data_ptr() for e in experts]]
    if not scales:
        cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * count]
        return
    s13, s2 = scales["w13_scale"], scales["w2_scale"]
    cfg.gate_scales = [[s13[e, :gate_scale_rows].data_ptr() for e in experts]]
    cfg.up_scales = [[s13[e, gate_scale_rows:].data_ptr() for e in experts]]
    cfg.down_scales = [[s2[e].data_ptr() for e in experts]]
    cfg.quant_config.zero_point = False
    if fmt == "fp8_block":
        cfg.quant_config.bits, cfg.quant_config.group_size = 8, FP8_BLOCK
    else:  # nvfp4
        cfg.quant_config.bits, cfg.quant_config.group_size = 4, GROUP


def _kt_scales(fmt: str, bank: Parts, inter: int) -> Parts:
    """The scales kt reads: fp8's are ours; nvfp4's are folded into bf16 [E, R, C/16], as kt's
    NVFP4SafeTensorLoader folds a checkpoint's; bf16 has none."""
    if fmt == "fp8_block":
        return {"w13_scale": bank["w13_scale"], "w2_scale": bank["w2_scale"]}
    if fmt != "nvfp4":
        return {}
    gate_up = bank["w13_scale_2"].repeat_interleave(inter, dim=1)  # [E, 2I]: row r -> r // I
    s13 = bank["w13_scale"].float() * gate_up[..., None]
    s2 = bank["w2_scale"].float() * bank["w2_scale_2"][..., None]
    return {"w13_scale": s13.to(torch.bfloat16), "w2_scale": s2.to(torch.bfloat16)}


def _kt_expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one expert as kt holds it: bf16 2 per weight; fp8 1 plus a float32 per
    128 x 128 block; nvfp4 1/2 plus a float32 per 16 (kt keeps fp32 group scales)."""
    weights = 3 * hidden * inter
    if fmt == "bf16":
        return 2 * weights
    if fmt == "fp8_block":
        blocks = -(-hidden // FP8_BLOCK) * -(-inter // FP8_BLOCK)
        return weights + 4 * 3 * blocks
    return weights // 2 + 4 * (weights // GROUP)


def _fp4(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 [R, C] of e2m1 codes [R, C/2] (low nibble first) x bf16 scales [R, C/16]."""
    values = BYTE_PAIRS[codes.long()].flatten(-2)  # [R, C]
    return (values.unflatten(-1, (-1, GROUP)) * scale.float()[..., None]).flatten(-2)
