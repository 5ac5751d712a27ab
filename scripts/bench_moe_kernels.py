"""Micro-benchmark of the Triton expert kernels (triton_moe_pairs) per bank format, at decode
batch sizes, on CUDA: one JSON line per case with the time of one layer's call and the
effective bandwidth over the expert bytes it must read (distinct experts x bytes per expert).

    python scripts/bench_moe_kernels.py [--formats bf16,int8,fp8_block,nvfp4] [--batches 1,4]
        [--shapes qwen3-30b-a3b,seed-next] [--iters 200] [--sweep]

Each call routes its tokens to fresh random experts (a bank of all the layer's experts, far
larger than L2), cycling through 64 precomputed routings. Timed with CUDA events twice: eager
(Python launch overhead included) and replaying a CUDA graph of the 64 calls (GPU time only;
the figure to hold against the HBM roofline). --sweep also times other tile sizes per kernel
(rows with "sweep": "gate_up" or "down") to retune triton_moe.TILES.

Legend: E = experts, D = hidden, I = expert intermediate, T = tokens, K = top-k.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = {  # name -> (D, I, E, K), as ft's presets
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "seed-next": (2560, 640, 512, 10),
}
ROUTINGS = 64  # distinct routings per case, cycled
DEVICE = "cuda"
SWEEP_BN = (16, 32, 64)
SWEEP_BK = {"bf16": (64, 128), "int8": (64, 128), "fp8_block": (64, 128), "nvfp4": (128, 256)}


def random_bank(fmt: str, d: int, inter: int, experts: int) -> dict[str, torch.Tensor]:
    """A bank with the contract's parts, shapes and dtypes; random contents (speed only)."""
    if fmt == "nvfp4":
        return nvfp4_bank(d, inter, experts)
    w13 = torch.randn(experts, 2 * inter, d, device=DEVICE, dtype=torch.bfloat16) / d**0.5
    w2 = torch.randn(experts, d, inter, device=DEVICE, dtype=torch.bfloat16) / inter**0.5
    if fmt == "bf16":
        return {"w13": w13, "w2": w2}
    if fmt == "int8":
        q13, q2 = ((w * 400).clamp(-127, 127).to(torch.int8) for w in (w13, w2))
        return {"w13": q13, "w2": q2, "w13_scale": _scale(experts, 2 * inter),
                "w2_scale": _scale(experts, d)}  # fmt: skip
    blocks_d, blocks_i = -(-d // 128), -(-inter // 128)
    return {
        "w13": (w13 * 400).to(torch.float8_e4m3fn),
        "w2": (w2 * 400).to(torch.float8_e4m3fn),
        "w13_scale": _scale(experts, 2 * blocks_i, blocks_d),  # gate's block rows, then up's
        "w2_scale": _scale(experts, blocks_d, blocks_i),
    }


def nvfp4_bank(d: int, inter: int, experts: int) -> dict[str, torch.Tensor]:
    bank = {}
    for name, rows, cols, halves in (("w13", 2 * inter, d, 2), ("w2", d, inter, 1)):
        codes = torch.randint(0, 256, (experts, rows, cols // 2), device=DEVICE)
        bank[name] = codes.to(torch.uint8)  # two e2m1 codes a byte
        bank[name + "_scale"] = _scale(experts, rows, cols // 16).mul(1e4).to(torch.float8_e4m3fn)
        bank[name + "_scale_2"] = _scale(experts, halves)
    return bank


def _scale(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, device=DEVICE) * 1e-3 + 1e-4


def bytes_per_expert(bank: dict[str, torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in bank.values())


def routings(tokens: int, top_k: int, experts: int):
    """-> [(PairBlocks, distinct experts)] for ROUTINGS random routings (slot = expert)."""
    from ft.engine.experts.grouped import blocks_on_device

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out = []
    for _ in range(ROUTINGS):
        ids = torch.stack(
            [torch.randperm(experts, device=DEVICE, generator=gen)[:top_k] for _ in range(tokens)]
        )  # [T, K]
        weights = torch.softmax(torch.rand(tokens, top_k, device=DEVICE, generator=gen), -1)
        out.append((blocks_on_device(ids, weights), len(set(ids.flatten().tolist()))))
    return out


def time_case(x, bank, fmt: str, work, iters: int) -> dict:
    """-> microseconds per call, eager and from a CUDA graph of one pass over `work`."""
    from ft.engine.kernels.moe import triton_moe_pairs

    def one_pass():
        for blocks, _ in work:
            triton_moe_pairs(x, bank, blocks, fmt)

    one_pass()  # compile
    torch.cuda.synchronize()
    passes = max(1, iters // len(work))
    eager = _events(one_pass, passes)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        one_pass()  # warm the graph pool's allocations on a side stream, as torch advises
        with torch.cuda.graph(graph, stream=stream):
            one_pass()
    torch.cuda.synchronize()
    replay = _events(graph.replay, passes)
    calls = len(work)
    return {"us_eager": 1e3 * eager / calls, "us_graph": 1e3 * replay / calls}


def _events(fn, repeats: int) -> float:
    """-> median milliseconds of fn() over repeats, by CUDA events (one warm-up dropped)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cases(args):
    for shape in args.shapes:
        d, inter, experts, top_k = SHAPES[shape]
        for fmt in args.formats:
            bank = random_bank(fmt, d, inter, experts)
            for batch in args.batches:
                yield shape, fmt, batch, bank
            del bank
            torch.cuda.empty_cache()


def tile_variants(fmt: str, sweep: bool):
    """-> [(which, gate/up tiles, down tiles)]: the defaults, then one kernel's alternatives."""
    from ft.engine.kernels import moe as triton_moe

    gu, dn = triton_moe.TILES[fmt]
    out = [("default", gu, dn)]
    if not sweep:
        return out
    for bn in SWEEP_BN:
        for bk in SWEEP_BK[fmt]:
            alt = dict(BN=bn, BK=bk)
            if alt != gu:
                out.append(("gate_up", alt, dn))
            if alt != dn:
                out.append(("down", gu, alt))
    return out


def run(args) -> None:
    from ft.engine.kernels import moe as triton_moe

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    meta["triton"] = __import__("triton").__version__
    for shape, fmt, batch, bank in cases(args):
        d, inter, experts, top_k = SHAPES[shape]
        work = routings(batch, top_k, experts)
        x = torch.randn(batch, d, device=DEVICE, dtype=torch.bfloat16)
        per_expert = bytes_per_expert(bank)
        read = sum(n for _, n in work) / len(work) * per_expert  # bytes a call must read
        default = triton_moe.TILES[fmt]
        for which, gu, dn in tile_variants(fmt, args.sweep):
            triton_moe.TILES[fmt] = (gu, dn)
            try:
                times = time_case(x, bank, fmt, work, args.iters)
                gu, dn = triton_moe.tiles_for(fmt, work[0][0].block_m, x.dtype)  # as run
            finally:
                triton_moe.TILES[fmt] = default
            row = dict(shape=shape, fmt=fmt, batch=batch, D=d, I=inter, experts=experts,
                       top_k=top_k, block_m=work[0][0].block_m, sweep=which,
                       gate_up_tiles=gu, down_tiles=dn,
                       expert_bytes=per_expert, bytes_per_call=round(read), **times,
                       gbs_graph=read / times["us_graph"] / 1e3,
                       gbs_eager=read / times["us_eager"] / 1e3, **meta)  # fmt: skip
            print(json.dumps(row), flush=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bf16,int8,fp8_block,nvfp4")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=640, help="timed calls per case (per timing)")
    p.add_argument("--sweep", action="store_true", help="also time other tile sizes")
    args = p.parse_args(argv)
    args.formats, args.shapes = args.formats.split(","), args.shapes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("error: bench_moe_kernels needs a CUDA GPU", file=sys.stderr)
        return 1
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
