"""ns per weight row of the CPU pool's per-row dots (`int_dots`, `bf16_dots`, the float path),
one core, rows from L2: what a change to a row's decode or dot does, without the pool's threads,
calls or DRAM in the figure (docs/cpu-pool.md). One JSON line per format and token count.

    python scripts/bench_cpu_rows.py --tokens 1,2,4,8 --reps 400
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import njit

from ft.engine.cpu import layer_kernel as K

FORMATS = {"bf16": K.BF16, "int8": K.INT8, "fp8_block": K.FP8, "nvfp4": K.NVFP4}


def projection(fmt: int, rows: int, cols: int, rng) -> tuple[np.ndarray, list[np.ndarray]]:
    """A gate/up projection of `rows` rows in the kernel's layout: (its parts' addresses, the
    arrays behind them, to keep alive). Values are arbitrary but valid (no NaN codes)."""
    if fmt == K.BF16:
        arrays = [rng.integers(0x3C00, 0x3F00, (rows, cols)).astype(np.uint16)]
    elif fmt == K.INT8:
        arrays = [rng.integers(-127, 128, (rows, cols)).astype(np.int8), np.ones(rows, np.float32)]
    elif fmt == K.FP8:
        codes = rng.integers(0, 256, (rows, cols)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 1
        arrays = [codes, np.ones((-(-rows // 128), -(-cols // 128)), np.float32)]
    else:
        codes = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
        groups = np.full((rows, cols // 16), 0x38, np.uint8)  # e4m3 1.0
        arrays = [codes, groups, np.ones(2, np.float32)]
    parts = np.zeros(K.PARTS, np.int64)
    for slot, a in zip((K.W13, K.W13_SCALE, K.W13_SCALE_2), arrays, strict=False):
        parts[slot] = a.ctypes.data
    return parts, arrays


@njit(fastmath=True)
def _rows(fmt, parts, rows, cols, reps, tokens, buf, wb, groups, vq, vs, vc, vb, xf, sel, dots):
    """reps passes over `rows` rows, each dotted with `tokens` tokens as run_call does (its
    buffers, like the call's, without reference counts)."""
    integer, bf16 = K.integer_dot(fmt, tokens), K.bf16_dotted(fmt)
    parts, buf, wb, groups = K.unowned(parts), K.unowned(buf), K.unowned(wb), K.unowned(groups)
    vq, vs, vc, vb = K.unowned(vq), K.unowned(vs), K.unowned(vc), K.unowned(vb)
    xf, sel, dots = K.unowned(xf), K.unowned(sel), K.unowned(dots)
    for _ in range(reps):
        for r in range(rows):
            if integer:
                K.int_dots(fmt, parts, K.W13, r, cols, rows, buf, vq, vs, vc, sel, 0, tokens, dots)
            elif bf16:
                K.bf16_dots(fmt, parts, K.W13, r, cols, rows, wb, groups, vb, sel, 0, tokens,
                            dots)  # fmt: skip
            else:
                K.float_dots(fmt, parts, K.W13, r, cols, rows, buf, groups, xf, sel, 0, tokens,
                             dots)  # fmt: skip
    return dots[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--cols", type=int, default=2048, help="row length (hidden; 2048: qwen3-30b)")
    ap.add_argument("--rows", type=int, default=128, help="rows per pass (128 x 2048 bf16: L2)")
    ap.add_argument("--reps", type=int, default=400, help="passes over the rows per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings; the fastest is shown")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    counts = [int(t) for t in a.tokens.split(",")]
    tmax, cols = max(counts), a.cols
    buf, wb = np.zeros(cols, np.float32), np.zeros(cols, np.uint16)
    groups = np.zeros(cols // 16 + 1, np.float32)
    x = rng.standard_normal((tmax, cols)).astype(np.float32)
    vb = rng.integers(0x3C00, 0x3F00, (tmax, cols)).astype(np.uint16)  # bf16 bits
    sel, dots = np.arange(tmax, dtype=np.int64), np.zeros(tmax, np.float32)
    for name in a.formats.split(","):
        fmt = FORMATS[name]
        parts, keep = projection(fmt, a.rows, cols, rng)
        vq, vs, vc = K.quantized_act(fmt, tmax, cols)  # the integer dot's activations
        for t in range(tmax):
            K.quantize_act(fmt, x[t], vq[t], vs[t], vc[t])
        for tokens in counts:
            args = (fmt, parts, a.rows, cols)
            more = (tokens, buf, wb, groups, vq, vs, vc, vb, x, sel, dots)  # x: the float path's
            _rows(*args, 1, *more)  # compile, warm
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                _rows(*args, a.reps, *more)
                best = min(best, time.perf_counter() - t)
            path = ("integer" if K.integer_dot(fmt, tokens)
                    else "bf16" if K.bf16_dotted(fmt) else "float")  # fmt: skip
            if path == "integer" and K.wide_dot(fmt, cols):
                path = "integer-wide"
            if path == "float" and K.f32_fused(fmt, cols):
                path = "float-fused"
            ns = best / (a.reps * a.rows) * 1e9
            print(json.dumps({"format": name, "tokens": tokens, "path": path, "cols": cols,
                              "ns_per_row": round(ns, 1)}), flush=True)  # fmt: skip
        del keep


if __name__ == "__main__":
    main()
