"""`ft bench cpu-moe`: the CPU MoE pool's throughput per expert format, experts per call and
tokens, beside the host's read bandwidth measured in the same process (docs/cpu-pool.md).

Experts of qwen3-30b-a3b's shape (D=2048, I=768). Each format's store is at least `store_gib`
and is walked in order, so a call reads experts that no recent call read: no read is a hit in
the CPU's caches. Each format and token count is first checked against float32 torch on the
dequantised weights. GB/s = distinct experts x bytes per expert / median seconds per call, from
submit to wait, as hybrid runs it.

With a peer (`--peer kt`: ft/bench/kt_peer.py), each cell also measures the peer's kernel on
the same store, shapes and inputs, its calls interleaved with the pool's (pool, peer, pool, ...,
one cursor through the store), each checked first like the pool. Before each timed call the
process's threads are let go idle (`settle`, untimed): kt's workers spin ~50 ms after a call,
on the cores the pool's next call needs, so back to back each side's figure would carry the
other's spin. With `interleave` off, each cell runs the pool's calls back to back, then (once
the process is idle) the peer's: each side in its own steady state, as a decode loop calls it,
the other's workers asleep (at 15 threads kt's workers woke ~12 ms late from a settle).

A peer is an object with start(threads), layer(fmt, bank, count, max_tokens, max_k) -> a layer
or a "no path: ..." note, describe() -> dict and close(). A layer has name, method, expert_bytes
(as the peer holds one), host_bytes (resident memory its load took: exact for the first format,
later ones may reuse what an earlier layer freed), weights(expert) -> float32 (w13, w2) as it
holds them, call(x, experts, weight) -> a prepared call returning out [T, D], and close().
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ft import cpuinfo
from ft.bench.bw_formats import ENGINE_FORMAT_NAMES, FORMATS, BenchFormat
from ft.bench.bw_links import cpu_stream_read_gbs
from ft.engine.cpu.pool import COMPUTE_MODES, LAYER_MODES, CpuMoeExecutor
from ft.errors import FtError

HIDDEN, INTER = 2048, 768
WARMUP_CALLS = 5  # dropped: the first calls wake sleeping workers and fault in the plan's pages
ROUTER_WEIGHT = 0.5  # every token's weight for every expert of a call
# _verify: act roundings allowed to differ per call (a few per call at D=2048, I=768: 1.3
# median, 2.7 the most in 300 calls, in units of the largest; a wrong block or scale is far off)
ACT_FLIPS = 8
CHECKED = [0, 1]  # the experts of each side's check call
PEERS = ("kt",)  # `--peer`: kernels measured beside the pool
SETTLE_WINDOW_S, SETTLE_IDLE, SETTLE_MAX_S = 0.005, 0.2, 0.5  # idle: < 20% of a core
# a side's block (--no-interleave) waits longer, once a cell: every call of the block runs beside
# whatever is still busy, where a per-call wait risks one call
BLOCK_SETTLE_MAX_S = 3.0


@dataclass(frozen=True)
class CpuMoeBenchConfig:
    formats: tuple[str, ...] = ENGINE_FORMAT_NAMES
    experts_per_call: tuple[int, ...] = (1, 2, 8)  # a layer's CPU share at decode
    tokens: tuple[int, ...] = (1, 4)  # decode batch: every token goes to every expert
    calls: int = 40  # timed calls per cell
    store_gib: float = 1.0  # per format: larger than the CPU's caches
    threads: int | None = None  # pool threads (default: physical cores - 1)
    computes: tuple[str, ...] = ("auto",)  # pool compute modes, e.g. auto,native
    peer: str | None = None  # a peer's kernel measured beside the pool's, interleaved
    settle: bool = True  # with a peer: each timed call starts once the process is idle
    interleave: bool = True  # with a peer: pool, peer, pool, ...; else each side's in a block
    phases: bool = False  # each pool call's workers stamp their phases: a row's `phases`

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            bad = ", ".join(unknown) or "(none)"
            raise FtError(f"--formats: unknown expert format {bad}; known: {', '.join(FORMATS)}")
        no_cpu = [f for f in self.formats if not FORMATS[f].cpu_path]
        if no_cpu:
            raise FtError(f"--formats: {', '.join(no_cpu)} has no CPU path to measure")
        bad_modes = [c for c in self.computes if c not in COMPUTE_MODES]
        if bad_modes or not self.computes:
            raise FtError(f"--compute must be among {', '.join(COMPUTE_MODES)}, got {bad_modes}")
        for flag, values in (("--experts-per-call", self.experts_per_call),
                             ("--tokens", self.tokens)):  # fmt: skip
            if not values or min(values) < 1:
                raise FtError(f"{flag} takes whole numbers >= 1, got {list(values)}")
        if self.calls < 1 or self.store_gib <= 0:
            raise FtError("--calls must be >= 1 and --store-gib positive")
        no_phases = [c for c in self.computes if c not in LAYER_MODES]
        if self.phases and no_phases:
            raise FtError(f"--phases: compute {', '.join(no_phases)} runs no layer kernel to "
                          "stamp; use auto or compiled")  # fmt: skip
        if self.threads is not None and self.threads < 1:
            raise FtError(f"--threads must be at least 1, got {self.threads}")
        if self.peer is not None and self.peer not in PEERS:
            raise FtError(f"--peer: unknown peer {self.peer!r}; known: {', '.join(PEERS)}")


def run_cpu_moe(cfg: CpuMoeBenchConfig, progress: Callable[[str], None] = print,
                peer: Any = None) -> dict:  # fmt: skip
    """{threads (workers), computing_threads (and the caller), stream_read_gbs (at that many
    threads), hidden, inter, rows: one per format, compute, tokens and
    experts per call; with a peer, peer: what it is and what each format's layer holds}.
    `peer`: a peer object (module docstring); default: the one `cfg.peer` names."""
    if peer is None and cfg.peer:
        peer = make_peer(cfg.peer)  # not installed: FtError before any store is filled
    with CpuMoeExecutor(threads=cfg.threads) as pool:
        threads = pool.threads  # what the default resolves to on this box
        computing = pool.computing_threads  # the caller too, where it has a core of its own
    progress("host read bandwidth")
    read = cpu_stream_read_gbs(1 << 30, computing, 10, 2)  # as many threads as stream a call
    rows, layers = [], {}
    if peer is not None:
        # as many pool threads each side, each with its calling thread beside them: kt's
        # CPUInfer(N) computes on N and its caller waits in sync(); at N = every core
        # (16 on the H100 box) it oversubscribed them, 0.5-25 GB/s where 15 gave 26-105
        peer.start(threads)
    try:
        for name in cfg.formats:
            fmt = FORMATS[name]
            progress(f"{name}: filling a {cfg.store_gib:g} GiB store")
            count = max(4 * max(cfg.experts_per_call), int(cfg.store_gib * 2**30 / _bytes(fmt)) + 1)
            # as the engine's store: pinned on CUDA hosts, on huge pages elsewhere
            _, bank = fmt.make_store(count, HIDDEN, INTER, pin=torch.cuda.is_available())
            other = None
            if peer is not None:
                progress(f"{name}: {peer.name} loads the store")
                most = max(cfg.tokens), max(len(CHECKED), *cfg.experts_per_call)
                other = peer.layer(fmt, bank, count, *most)
                layers[name] = _layer_info(other, count, fmt)
            try:
                for compute in cfg.computes:
                    progress(f"{name}: pool compute={compute}")
                    with CpuMoeExecutor(threads=threads, compute=compute) as pool:
                        if cfg.phases:
                            pool.stamp_phases()
                        rows += _measure_format(pool, fmt, bank, count, compute, cfg, read, other)
                if other is not None and not isinstance(other, str):
                    layers[name]["reads_our_store"] = _reads_our_store(other, fmt, bank)
            finally:
                if other is not None and not isinstance(other, str):
                    other.close()
            del bank, other  # one format's store in memory at a time
    finally:
        if peer is not None:
            peer.close()
    result = dict(threads=threads, computing_threads=computing, stream_read_gbs=read,
                  hidden=HIDDEN, inter=INTER, rows=rows)  # fmt: skip
    if peer is not None:
        result["peer"] = dict(peer.describe(), layers=layers, settle=cfg.settle,
                              interleave=cfg.interleave)  # fmt: skip
    return result


def make_peer(name: str):
    """The peer `--peer` names; FtError (one line, how to install it) where it is not here."""
    from ft.bench.kt_peer import KtPeer  # kt-kernel: only for --peer kt

    return {"kt": KtPeer}[name]()


def _layer_info(layer, count: int, fmt: BenchFormat) -> dict:
    """What the peer's layer holds beside our store: its bytes per expert, the store as it
    holds it, and the resident memory its load took (a copy, or pointers into ours)."""
    if isinstance(layer, str):
        return dict(note=layer)
    return dict(
        method=layer.method, experts=count, expert_bytes=layer.expert_bytes,
        held_mib=round(count * layer.expert_bytes / 2**20, 1),
        ours_mib=round(count * _bytes(fmt) / 2**20, 1), rss_mib=round(layer.host_bytes / 2**20, 1),
    )  # fmt: skip


def _reads_our_store(layer, fmt: BenchFormat, bank) -> bool:
    """Whether the peer still computes from our store after its load: its output changes when
    our store is zeroed (last thing done with the store)."""
    x = torch.randn(1, HIDDEN).to(fmt.dtype)
    before = layer.call(x, CHECKED, ROUTER_WEIGHT)().clone()
    for part in bank.values():
        part.zero_()
    return not torch.equal(before, layer.call(x, CHECKED, ROUTER_WEIGHT)())


class _PoolSide:
    """The pool as one side of a cell, shaped like a peer's layer."""

    name = "the pool"

    def __init__(self, pool: CpuMoeExecutor, fmt: BenchFormat, bank) -> None:
        self.pool, self.fmt, self.bank, self.expert_bytes = pool, fmt, bank, _bytes(fmt)
        self.submit_s = 0.0  # the last call's submit (the caller's side), for the row
        self.handle = None  # the last call's

    def act_rounding(self, tokens: int):
        """The layer kernel's rounding of x and act (layer.act_rounding) or None."""
        return self.pool.act_rounding(self.fmt.form.name, self.bank["w13"].dtype, tokens)

    def weights(self, expert: int):
        return self.fmt.form.dequantize({k: t[expert] for k, t in self.bank.items()}, torch.float32)

    def call(self, x, experts: list[int], weight: float):
        """Every token routed to every expert; timed from the routing to the result, as hybrid
        submits a layer's CPU share (submit_routed)."""
        ids = torch.tensor(experts).repeat(x.shape[0], 1)  # [T, k], contiguous as hybrid's
        weights = torch.full(ids.shape, weight)
        fmt = self.fmt.form.name

        def run():
            start = time.perf_counter()
            handle = self.pool.submit_routed(x, self.bank, fmt, ids, weights, experts)
            self.submit_s = time.perf_counter() - start  # the caller's side: the plan, built
            self.handle = handle
            return handle.wait()

        return run


def _measure_format(pool, fmt: BenchFormat, bank, count: int, compute: str, cfg, read,
                    other=None) -> list:  # fmt: skip
    """One row per tokens x experts per call; `other`: the peer's layer, a "no path" note, or
    None (no peer)."""
    sides = {"": _PoolSide(pool, fmt, bank)}  # row key prefix -> side
    # a caller on one of these shares a core with a pinned worker; None: the pool takes every
    # core, so the caller shares one by design (the pool spins briefly there)
    worker_cores = set(pool.cores) if set(cpuinfo.allowed_cores()) - set(pool.cores) else None
    if other is not None and not isinstance(other, str):
        sides["peer_"] = other
    rows, cursor = [], 0
    for tokens in cfg.tokens:
        x = torch.randn(tokens, HIDDEN).to(fmt.dtype)
        errs = {key: _verify(side.name, side, fmt, x) for key, side in sides.items()}
        for k in cfg.experts_per_call:
            times, submits, phases, helped = {key: [] for key in sides}, [], [], []
            busy = {key: 0 for key in sides}  # timed calls started with the process still busy
            shared = 0 if worker_cores is not None else None  # calls ending on a worker's core
            for call, key in _call_order(list(sides), WARMUP_CALLS + cfg.calls, cfg.interleave):
                side = sides[key]
                run = side.call(x, [(cursor + j) % count for j in range(k)], ROUTER_WEIGHT)
                cursor += k
                # a format the peer lacks settles too: its threads spin after its last call
                if other is not None and (cfg.settle if cfg.interleave else call == 0):
                    idle = settle(SETTLE_MAX_S if cfg.interleave else BLOCK_SETTLE_MAX_S)
                    if not idle and cfg.interleave:
                        busy[key] += call >= WARMUP_CALLS
                    elif not idle:
                        busy[key] = cfg.calls  # the block's calls all run beside it
                start = time.perf_counter()
                run()
                if call >= WARMUP_CALLS:
                    times[key].append(time.perf_counter() - start)
                    if key == "":
                        submits.append(side.submit_s)
                        helped.append(getattr(side.handle, "caller_units", 0))  # task path: 0
                        # where the caller ran its wait (read after it, untimed): on a worker's
                        # core the two share it; the pool's cores are its workers' alone
                        if worker_cores is not None:
                            shared += cpuinfo.current_cpu() in worker_cores
                        if cfg.phases:
                            phases.append(side.handle.phases())
            row = dict(fmt=fmt.name, compute=compute, tokens=tokens, experts=k,
                       submit_us=round(statistics.median(submits) * 1e6, 1),
                       caller_units=statistics.median(helped),
                       caller_on_worker_core=shared)  # fmt: skip
            for key, side in sides.items():
                row.update(_cell(key, times[key], k * side.expert_bytes, read, errs[key]))
            if other is not None:
                row.update(_peer_cells(row, other))
                row["busy_calls"] = {"pool": busy[""], "peer": busy.get("peer_", 0)}
            if phases:
                from ft.engine.cpu.phases import summarize  # numba: only with --phases

                row["phases"] = summarize(phases)
            rows.append(row)
    return rows


def _call_order(keys: list[str], calls: int, interleave: bool) -> list[tuple[int, str]]:
    """(call number, side) in the order they run: interleaved, the pool's call, the peer's, ...;
    else each side's calls back to back, one side after the other."""
    if interleave:
        return [(call, key) for call in range(calls) for key in keys]
    return [(call, key) for key in keys for call in range(calls)]


def settle(max_s: float = SETTLE_MAX_S) -> bool:
    """Sleep until this process's threads are idle (under SETTLE_IDLE of a core over a
    window), at most max_s: no worker of either side still spinning from its last call.
    Whether it went idle (else the next calls run beside whatever kept it busy)."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_s:
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(SETTLE_WINDOW_S)
        if time.process_time() - cpu < SETTLE_IDLE * (time.perf_counter() - wall):
            return True
    return False


def _cell(key: str, times: list[float], nbytes: int, read: float, err: float) -> dict:
    secs = statistics.median(times)
    gbs = nbytes / secs / 1e9
    of_read = round(gbs / read, 3) if read else None
    return {f"{key}us": round(secs * 1e6, 1), f"{key}gbs": round(gbs, 2),
            f"{key}of_read": of_read, f"{key}max_err": err}  # fmt: skip


def _peer_cells(row: dict, other) -> dict:
    """ratio = the pool's GB/s / the peer's; where the peer has no path, its note instead."""
    if isinstance(other, str):
        return dict(peer_us=None, peer_gbs=None, peer_of_read=None, peer_max_err=None,
                    ratio=None, peer_note=other)  # fmt: skip
    return dict(ratio=round(row["gbs"] / row["peer_gbs"], 2), peer_note=None)


def _bytes(fmt: BenchFormat) -> int:
    return fmt.expert_bytes(HIDDEN, INTER)


def _check(pool: CpuMoeExecutor, fmt: BenchFormat, bank, tokens: int) -> float:
    """The pool's max abs error on a two-expert call against float32 torch (_verify)."""
    x = torch.randn(tokens, HIDDEN).to(fmt.dtype)
    return _verify("the pool", _PoolSide(pool, fmt, bank), fmt, x)


def _verify(label: str, side, fmt: BenchFormat, x) -> float:
    """Max abs error of `side`'s two-expert call on x against float32 torch on the weights it
    holds; FtError where it is off by more than float32 rounding plus its output dtype's (a
    figure of a wrong kernel is no figure). A side that rounds its activations (`act_rounding`:
    the pool's integer dot, to int8 per block; its bf16 dot, to bf16) is checked against torch
    rounding them alike, allowed ACT_FLIPS more roundings that land on the other side of a
    half-step (the two sides' float act differ in the last bits): each moves one act element by
    one step, at most amax / 127 (bf16's: amax / 128), so an output by that times max |w2|."""
    tokens = x.shape[0]
    got = side.call(x, CHECKED, ROUTER_WEIGHT)()
    want = torch.zeros(tokens, HIDDEN)
    rounding = getattr(side, "act_rounding", lambda n: None)(tokens)
    xr = rounding(x.float()) if rounding else x.float()
    flips = 0.0
    for expert in CHECKED:
        w13, w2 = side.weights(expert)
        act = ROUTER_WEIGHT * F.silu(xr @ w13[:INTER].T) * (xr @ w13[INTER:].T)  # [T, I]
        if rounding:
            act = rounding(act)
            flips += ACT_FLIPS * act.abs().max().item() / 127 * w2.abs().max().item()
        want += act @ w2.T
    if tuple(got.shape) != (tokens, HIDDEN):
        raise FtError(f"{fmt.name} T={tokens}: {label} returned shape {tuple(got.shape)}")
    top = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    allowed = 1e-3 * max(1.0, top) + torch.finfo(got.dtype).eps * top + flips  # kt: bf16
    if not err <= allowed:  # NaN too
        raise FtError(f"{fmt.name} T={tokens}: {label} differs from float32 torch by {err:.3g} "
                      f"(allowed {allowed:.2g}); no figure for it")  # fmt: skip
    return err
