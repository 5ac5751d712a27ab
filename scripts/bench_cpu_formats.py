"""One CPU core's expert FFN per quantised format, two ways, interleaved on the same box:
"kernels" (what the CPU MoE pool runs: ExpertFormat.rows_dot on the codes, compiled) and
"torch" (the path it replaced: dequantise the block with tensor ops, then matmuls in float32).
One JSON line per (format, way): GB/s of expert bytes, the median over --rounds of --iters.

    python scripts/bench_cpu_formats.py [--tokens 1] [--rounds 5] [--iters 10] [--block 768]

Shapes of qwen3-30b-a3b (D=2048, I=768); --block is the rows of I per call (the pool's blocks
at decode are smaller: I split over its threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from ft.engine.formats import get_format

D, INTER = 2048, 768


def kernels(form, parts, x, lo, hi):
    gate, up = (np.empty((x.shape[0], hi - lo), np.float32) for _ in range(2))
    form.rows_dot(parts, "w13", lo, hi, 0, x.numpy(), gate)
    form.rows_dot(parts, "w13", INTER + lo, INTER + hi, 0, x.numpy(), up)
    act = F.silu(torch.from_numpy(gate)) * torch.from_numpy(up)
    out = np.empty((x.shape[0], D), np.float32)
    form.rows_dot(parts, "w2", 0, D, lo, act.numpy(), out)
    return out


def dequantised(form, parts, x, lo, hi):
    s = hi - lo
    gu, down = torch.empty(2 * s, D), torch.empty(D, s)
    form.dequant_block(parts, lo, hi, gu, down)
    h = x @ gu.T
    return (F.silu(h[:, :s]) * h[:, s:]) @ down.T


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--block", type=int, default=INTER)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, D, generator=gen)
    for name in ("int8", "fp8_block", "nvfp4"):
        form = get_format(name)
        w13 = torch.randn(2 * INTER, D, generator=gen) / D**0.5
        parts = form.quantize(w13, torch.randn(D, INTER, generator=gen) / INTER**0.5)
        block_bytes = form.expert_bytes(D, INTER) * args.block / INTER
        ways = {"kernels": kernels, "torch": dequantised}
        ref = dequantised(form, parts, x, 0, args.block)
        got = torch.from_numpy(kernels(form, parts, x, 0, args.block))
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), name
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):  # interleaved: both ways see the same box
            for way, fn in ways.items():
                start = time.perf_counter()
                for _ in range(args.iters):
                    fn(form, parts, x, 0, args.block)
                seconds[way].append((time.perf_counter() - start) / args.iters)
        for way, times in seconds.items():
            median = statistics.median(times)
            print(json.dumps({"format": name, "way": way, "tokens": args.tokens,
                              "block": args.block, "us": round(median * 1e6),
                              "gbs": round(block_bytes / median / 1e9, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
