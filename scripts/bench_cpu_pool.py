"""Where the CPU MoE pool's bf16 time goes: memory bandwidth, whole experts per thread, and the
pool's submits, at 1..N threads on this box. One JSON line per measurement (GB/s of expert
bytes; `us` per submit for the pool).

    python scripts/bench_cpu_pool.py [--threads 1,2,4,8,15] [--experts 128] [--iters 24]

Shapes of qwen3-30b-a3b (D=2048, I=768), bf16, one token. The store (--experts of them, 9 MiB
each) is larger than any cache, and every thread walks it from its own offset, so no read is a
cache hit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

from ft.engine.cpu.pool import CpuMoeExecutor, ExpertJob
from ft.engine.cpu.threads import pick_cores, pin_to_core
from ft.engine.cpu import kernels as cpu_kernels

D, INTER = 2048, 768
EXPERT_BYTES = 3 * D * INTER * 2


def store(experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.empty(experts, 2 * INTER, D, dtype=torch.bfloat16).normal_(0, 0.02)
    w2 = torch.empty(experts, D, INTER, dtype=torch.bfloat16).normal_(0, 0.02)
    return w13, w2


def ffn_torch(x, w13, w2):
    h = x @ w13.T  # [1, 2I]
    return (F.silu(h[:, :INTER]) * h[:, INTER:]) @ w2.T


def ffn_numba(x, w13, w2):
    xf = x.float().numpy()
    h = np.empty((1, 2 * INTER), np.float32)
    cpu_kernels.bf16_rows(xf, w13.view(torch.int16).numpy().view(np.uint16), 0, 2 * INTER, 0, h)
    act = (F.silu(torch.from_numpy(h[:, :INTER])) * torch.from_numpy(h[:, INTER:])).numpy()
    out = np.empty((1, D), np.float32)
    cpu_kernels.bf16_rows(act, w2.view(torch.int16).numpy().view(np.uint16), 0, D, 0, out)
    return out


def threads_run(cores: list[int], work) -> float:
    """Seconds for every core's thread to run work(k) once, started together."""
    go = threading.Barrier(len(cores) + 1)
    done = [0.0] * len(cores)

    def run(k: int) -> None:
        pin_to_core(cores[k])
        torch.set_num_threads(1)
        go.wait()
        work(k)
        done[k] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(cores))]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return max(done) - start


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--iters", type=int, default=24)
    args = parser.parse_args()
    w13, w2 = store(args.experts)
    flat = w13.view(-1)
    x = torch.randn(1, D, dtype=torch.bfloat16)
    ffn_numba(x, w13[0], w2[0])  # compile
    n_exp, iters = args.experts, args.iters
    for n in [int(t) for t in args.threads.split(",")]:
        cores = pick_cores(n, None)
        chunk = flat.numel() // n

        def stream(k: int, chunk=chunk) -> None:  # this thread's share of the store, twice
            for _ in range(2):
                flat[k * chunk : (k + 1) * chunk].sum()

        secs = threads_run(cores, stream)
        emit(what="stream_read", threads=n, gbs=round(2 * chunk * n * 2 / secs / 1e9, 2))
        for name, ffn in (("whole_torch", ffn_torch), ("whole_numba", ffn_numba)):

            def whole(k: int, ffn=ffn, n=n) -> None:
                for i in range(iters):
                    e = (k * n_exp // n + i) % n_exp
                    ffn(x, w13[e], w2[e])

            secs = threads_run(cores, whole)
            emit(what=name, threads=n, gbs=round(n * iters * EXPERT_BYTES / secs / 1e9, 2))
        for compute in ("native", "compiled"):
            with CpuMoeExecutor(cores=cores, compute=compute) as pool:
                for k in (1, 2, 8):
                    times, cursor = [], 0
                    for i in range(iters + 4):
                        experts = [(cursor + j) % n_exp for j in range(k)]
                        cursor += k
                        one = (torch.zeros(1, dtype=torch.long), torch.ones(1))  # token 0, weight 1
                        jobs = [ExpertJob({"w13": w13[e], "w2": w2[e]}, *one) for e in experts]
                        t = time.perf_counter()
                        pool.submit(x, jobs).wait()
                        if i >= 4:
                            times.append(time.perf_counter() - t)
                    med = statistics.median(times)
                    emit(what=f"pool_{compute}", threads=n, experts=k, us=round(med * 1e6, 1),
                         gbs=round(k * EXPERT_BYTES / med / 1e9, 2))  # fmt: skip


if __name__ == "__main__":
    main()
