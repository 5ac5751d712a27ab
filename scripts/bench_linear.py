"""Micro-benchmark of decode's dense matmuls at small batch: torch's F.linear (cuBLAS) against
Triton GEMV candidates, on the qwen3-30b-a3b shapes, GPU time only (a CUDA graph of CALLS
calls, each on another copy of the weight so that no call finds it in L2, as in decode where 47
other layers' weights pass between two uses). One JSON line per (shape, batch, way).

    python scripts/bench_linear.py [--batches 1,4] [--calls 48]

Ways: `torch` (F.linear); `dot` (a Triton program per BN output columns: [16, BK] x [BK, BN]
tl.dot over K, rows past the batch masked, as the expert kernels do); `sum` (no tensor cores:
each program multiplies a [BN, BK] weight tile by the batch's rows and sums over K).

Legend: M = batch rows, N = output features, K = input features.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {  # name -> (N, K): qwen3-30b-a3b's decode matmuls
    "qkv": (5120, 2048),
    "o": (2048, 4096),
    "routers x3": (384, 2048),
    "lm_head": (151936, 2048),
}
L2_BYTES = 64 << 20


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BN: tl.constexpr, BK: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, 16)
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=cols[None, :] < N)
        acc += tl.dot(a, w)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=ok)


@triton.jit
def _sum_kernel(x_ptr, w_ptr, out_ptr, M, N, K, MB: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, MB)
    acc = tl.zeros((MB, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=cols[:, None] < N)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [MB, BN, BK]
        acc += tl.sum(prod, axis=2)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=ok)


def ways(m: int):
    """name, config, fn(x, w, out) for every candidate."""
    yield "torch", {}, lambda x, w, out: torch.matmul(x, w.t(), out=out)
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256), (4,), (3, 5)):
        cfg = dict(BN=bn, BK=bk, num_warps=warps, num_stages=stages)

        def run(x, w, out, cfg=cfg):
            n, k = w.shape
            _dot_kernel[(triton.cdiv(n, cfg["BN"]),)](x, w, out, x.shape[0], n, k, **cfg)

        yield "dot", cfg, run
    mb = triton.next_power_of_2(m)
    for bn, bk, warps in itertools.product((4, 8, 16, 32), (256, 512), (2, 4)):
        if mb * bn * bk > 2048 * warps:  # registers: <= 64 floats a thread
            continue
        cfg = dict(BN=bn, BK=bk, num_warps=warps)

        def run(x, w, out, cfg=cfg):
            n, k = w.shape
            _sum_kernel[(triton.cdiv(n, cfg["BN"]),)](x, w, out, x.shape[0], n, k, MB=mb, **cfg)

        yield "sum", cfg, run


def time_graph(fn, xs, ws, outs, calls: int) -> float:
    """GPU us per call: a graph of `calls` calls cycling over the weight copies."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(xs[i % len(xs)], ws[i % len(ws)], outs[i % len(outs)])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(xs[i % len(xs)], ws[i % len(ws)], outs[i % len(outs)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--calls", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    for (name, (n, k)), m in itertools.product(SHAPES.items(), map(int, args.batches.split(","))):
        nbytes = n * k * 2
        copies = max(1, min(args.calls, -(-2 * L2_BYTES // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        want = F.linear(xs[0].float(), ws[0].float())
        best: dict[str, tuple] = {}
        for way, cfg, fn in ways(m):
            try:
                fn(xs[0], ws[0], outs[0])
                err = (outs[0].float() - want).abs().max().item()
                us = time_graph(fn, xs, ws, outs, args.calls)
            except Exception as exc:  # a config that does not compile: skip it
                print(json.dumps(dict(shape=name, batch=m, way=way, cfg=cfg, error=str(exc)[:120])))
                continue
            row = dict(shape=name, batch=m, way=way, cfg=cfg, us=round(us, 2),
                       gbs=round(nbytes / us / 1e3, 1), max_err=round(err, 4))  # fmt: skip
            print(json.dumps(row), flush=True)
            if way not in best or us < best[way][0]:
                best[way] = (us, cfg)
        summary = {way: dict(us=round(us, 2), gbs=round(nbytes / us / 1e3, 1), cfg=cfg)
                   for way, (us, cfg) in best.items()}  # fmt: skip
        print(json.dumps(dict(shape=name, batch=m, best=summary)), flush=True)
        del ws


if __name__ == "__main__":
    main()
