"""Triton kernels behind ft.engine.model.fused (CUDA; TRITON_INTERPRET=1 on CPU tensors, tests).

`_round` casts to the model's dtype and back, so every step rounds where torch's ops would.
Legend: T = tokens, D = hidden, N = heads, d = head_dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.engine.kernels import codes


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, out_h_ptr, out_x_ptr, D, stride_h, stride_d, eps,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    s = _round(h + d, DTYPE)  # the residual stream, in the model's dtype
    tl.store(out_h_ptr + row * D + cols, s.to(DTYPE), mask=ok)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_x_ptr + row * D + cols, (w * _round(s * inv, DTYPE)).to(DTYPE), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, N, stride_xt, stride_xn, stride_c, eps,
    HALF: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    t, n = tl.program_id(0), tl.program_id(1)
    lo = tl.arange(0, HALF)
    base = x_ptr + t * stride_xt + n * stride_xn
    x1 = tl.load(base + lo).to(tl.float32)  # first half of the head
    x2 = tl.load(base + HALF + lo).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + n * 2 * HALF + lo).to(tl.float32)
    w2 = tl.load(w_ptr + n * 2 * HALF + HALF + lo).to(tl.float32)
    y1 = _round(w1 * _round(x1 * inv, DTYPE), DTYPE)
    y2 = _round(w2 * _round(x2 * inv, DTYPE), DTYPE)
    table = tl.load(pos_ptr + t) * stride_c  # the tables' row at t's position, rounded to
    # x's dtype as torch's gather and cast
    c1 = _round(tl.load(cos_ptr + table + lo).to(tl.float32), DTYPE)
    c2 = _round(tl.load(cos_ptr + table + HALF + lo).to(tl.float32), DTYPE)
    s1 = _round(tl.load(sin_ptr + table + lo).to(tl.float32), DTYPE)
    s2 = _round(tl.load(sin_ptr + table + HALF + lo).to(tl.float32), DTYPE)
    o1 = _round(y1 * c1, DTYPE) + _round(-y2 * s1, DTYPE)  # x * cos + rotate_half(x) * sin
    o2 = _round(y2 * c2, DTYPE) + _round(y1 * s2, DTYPE)
    out = out_ptr + (t * N + n) * 2 * HALF
    tl.store(out + lo, o1.to(DTYPE))
    tl.store(out + HALF + lo, o2.to(DTYPE))


_DTYPES = {"torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16, "torch.float32": tl.float32}


def add_rms_norm(h, delta, weight, out_h, out_x, eps: float) -> None:
    """out_h = h + delta, out_x = RMSNorm(out_h) * weight; h, delta [T, D] (rows may be strided)."""
    T, D = h.shape  # noqa: N806
    _add_rms_norm_kernel[(T,)](
        h, delta, weight, out_h, out_x, D, h.stride(0), delta.stride(0), eps,
        BLOCK=triton.next_power_of_2(D), DTYPE=_DTYPES[str(h.dtype)],
    )  # fmt: skip


def qk_norm_rope(x, weight, cos, sin, positions, out, eps: float) -> None:
    """out [T, N, d] = RoPE(RMSNorm(x) * weight) at `positions` [T]; x [T, N, d] with unit
    stride over d, weight [N, d], cos/sin the whole tables [M, d] (float32), each token's row
    gathered in the kernel (decode launches no gather of its own). d must be a power of two
    (128 in every preset)."""
    T, N, d = x.shape  # noqa: N806
    _qk_norm_rope_kernel[(T, N)](
        x, weight, cos, sin, positions, out, N, x.stride(0), x.stride(1), cos.stride(0), eps,
        HALF=d // 2, DTYPE=_DTYPES[str(x.dtype)],
    )  # fmt: skip


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, w_ptr, mirror_ptr, E, stride_l, stride_i, stride_m,
    K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr,
    MIRROR: tl.constexpr,
):  # fmt: skip
    t, g = tl.program_id(0), tl.program_id(1)  # one token, one router of the group
    cols = tl.arange(0, BE)
    z = tl.load(logits_ptr + t * stride_l + g * E + cols, mask=cols < E, other=float("-inf"))
    z = z.to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)  # softmax in float32
    p = tl.where(cols < E, p, -1.0)
    slots = tl.arange(0, KP)
    vals = tl.zeros((KP,), dtype=tl.float32)
    idxs = tl.zeros((KP,), dtype=tl.int64)
    for k in tl.static_range(K):  # top-k by K passes; ties go to the lower expert id
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BE), axis=0)
        vals = tl.where(slots == k, best, vals)
        idxs = tl.where(slots == k, idx, idxs)
        p = tl.where(cols == idx, -1.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + t * stride_i + g * K + slots, idxs, mask=slots < K)
    if MIRROR:  # the same ids where the host reads them (pinned memory: no copy back)
        tl.store(mirror_ptr + t * stride_m + g * K + slots, idxs, mask=slots < K)
    first = (slots + g * KP) < K  # the first router's weights only
    tl.store(w_ptr + t * K + slots, vals.to(DTYPE), mask=first)


# polls of a queued copy's ready mark (~0.3 us each) before the expert is read in place instead
MAX_SPINS = tl.constexpr(1 << 13)
# polls of a gate (pinned memory, read across PCIe) before the layer goes on without the host,
# reading its misses in place: some ms, where the host opens a gate once it has followed the
# layer (its poll and bookkeeping); past that the host is taken to be stalled
MAX_GATE_SPINS = tl.constexpr(1 << 14)
# hybrid on device gates: a table entry the CPU computes this step, and the gate's value when
# the host opens it with the CPU's share of the layer written (ft.engine.strategies.hybrid)
ON_CPU = tl.constexpr(codes.ON_CPU)
CPU_SHARE = tl.constexpr(codes.CPU_SHARE)


@triton.jit
def _ready_slots(slot, key, ok, ready_ptr, CODE, WAIT: tl.constexpr):
    """Which slots hold their expert's data: ready[slot] == CODE + expert, the mark the copy
    engine writes behind the data; WAIT: poll (bounded) while a copy is still queued."""
    has = ok & (slot >= 0)
    code = CODE + key
    mark = tl.load(ready_ptr + slot, mask=has, other=-1, volatile=True)
    if WAIT:
        spins = 0
        while (tl.sum((has & (mark != code)).to(tl.int32), axis=0) > 0) & (spins < MAX_SPINS):
            mark = tl.load(ready_ptr + slot, mask=has, other=-1, volatile=True)
            spins += 1
    return has & (mark == code)


@triton.jit
def _wait_for_host(gate_ptr):
    """Poll the layer's gate (bounded) until the host opens it -> its value (0: never)."""
    spins = 0
    opened = tl.load(gate_ptr, volatile=True)
    while (opened == 0) & (spins < MAX_GATE_SPINS):
        opened = tl.load(gate_ptr, volatile=True)
        spins += 1
    return opened


@triton.jit
def _gated_slots(key, ok, table_ptr, gate_ptr, kept_ptr):
    """Device gates: the slots of the layer's routed experts, read from the table once the host
    lets the layer go, and the gate's value (0: passed without it, or it never opened). A layer
    whose slots the host keeps for the rest of the step (`kept`) goes on at once where the
    table names a slot for every routed expert (the ready marks are still checked); else it
    waits for the gate, which the host opens once it has queued the layer's misses and named
    their slots. The table is read only after the flag or the gate has been
    seen set (a branch on their value: the GPU issues no load past an unresolved branch), so a
    slot the host took before keeping the layer is never read as named."""
    slot = tl.full(key.shape, -1, tl.int32)
    opened = 0
    named = tl.load(kept_ptr, volatile=True) != 0
    if named:
        slot = tl.load(table_ptr + key, mask=ok, other=-1, volatile=True)
        named = tl.sum((ok & (slot < 0)).to(tl.int32), axis=0) == 0
    if not named:
        opened = _wait_for_host(gate_ptr)
        slot = tl.load(table_ptr + key, mask=ok, other=-1, volatile=True)
    return slot, opened


@triton.jit
def _plan_kernel(
    ids_ptr, w_ptr, table_ptr, tok_ptr, slot_ptr, wout_ptr, bstart_ptr, bslot_ptr, row_ptr,
    count_ptr, uses_ptr, ready_ptr, gate_ptr, kept_ptr, cpu_ptr, P, NSLOT, CODE, stride_ids,
    K: tl.constexpr, BP: tl.constexpr, TABLE: tl.constexpr, IN_PLACE: tl.constexpr,
    WAIT: tl.constexpr, GATE: tl.constexpr, USES: tl.constexpr, CPU: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, BP)
    ok = i < P
    at = (i // K) * stride_ids + i % K  # ids [T, K] may be a strided view
    key = tl.load(ids_ptr + at, mask=ok, other=2**30).to(tl.int32)  # padding sorts last
    opened = 0
    if GATE:  # device gates: the host has fetched the layer's misses once it lets it go
        slot, opened = _gated_slots(key, ok, table_ptr, gate_ptr, kept_ptr)
    elif TABLE:  # volatile: the host may rewrite the table while a step runs (eager gates)
        slot = tl.load(table_ptr + key, mask=ok, other=-1, volatile=True)
    else:
        slot = key
    same = key[None, :] == key[:, None]  # [BP, BP]
    earlier = i[None, :] < i[:, None]
    rank = tl.sum(((key[None, :] < key[:, None]) | (same & earlier)).to(tl.int32), axis=1)
    first = tl.sum((same & earlier).to(tl.int32), axis=1) == 0  # the run's first pair
    on_cpu = i < 0  # none, but for hybrid's
    if CPU:  # the gate opened with the CPU's share written (CPU_SHARE), or not: read in place
        shared = opened == CPU_SHARE
        tl.store(cpu_ptr, shared.to(tl.int32))  # for the sum (reduce_pairs)
        on_cpu = ok & (slot == ON_CPU) & shared
    if IN_PLACE:  # slot not ready: the expert's row of the host store, NSLOT + expert
        missed = ok & ~on_cpu & ~_ready_slots(slot, key, ok, ready_ptr, CODE, WAIT)
        tl.atomic_add(count_ptr, tl.sum((missed & first).to(tl.int64), axis=0))  # once each
        slot = tl.where(missed, NSLOT + key, slot)
        slot = tl.where(on_cpu, -1, slot)  # computed by the CPU: skipped here
    if USES:  # the distinct experts computed from a slot: resident's use counter
        tl.atomic_add(uses_ptr, tl.sum((first & ok & (slot >= 0)).to(tl.int64), axis=0))
    weight = tl.load(w_ptr + i, mask=ok, other=0.0)
    tl.store(row_ptr + i, rank, mask=ok)  # where pair i (token i // K) lands: for the sum
    tl.store(tok_ptr + rank, (i // K).to(tl.int64), mask=ok)
    tl.store(slot_ptr + rank, slot, mask=ok)
    tl.store(wout_ptr + rank, weight, mask=ok)
    tl.store(bslot_ptr + rank, tl.where(first, slot, -1), mask=ok)
    tl.store(bstart_ptr + i, i, mask=ok)


def route_topk(logits, top_k: int, norm: bool, ids, weights, routers: int = 1, mirror=None) -> None:
    """For logits [T, routers * E] of `routers` routers side by side: ids [T, >= routers * K]
    int64 (rows may be strided), each router's softmax top-k in turn, also written to `mirror`
    (the same layout) if given; weights [T, K] (their dtype), the first router's."""
    T, E = logits.shape[0], logits.shape[1] // routers  # noqa: N806
    copy = mirror if mirror is not None else ids  # without one: a stand-in, never written
    _route_kernel[(T, routers)](
        logits, ids, weights, copy, E, logits.stride(0), ids.stride(0), copy.stride(0), K=top_k,
        KP=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(E), NORM=norm,
        DTYPE=_DTYPES[str(weights.dtype)], MIRROR=mirror is not None,
    )  # fmt: skip


def plan_pairs(
    ids, weights, table, tok, slot, weight, block_start, block_slot, row_of, in_place=None,
    uses=None,
) -> None:  # fmt: skip
    """The decode work list in one program: pairs ordered by expert id (stable), each run's
    first row owning a block; slot = table[expert] (table None: the expert id itself); row_of
    [P]: the row each pair (in routing order) lands on. in_place (grouped.InPlace, decode on
    gates): an expert whose slot is not ready gets num_slots + expert (read from the host store
    in place) and counts once in its misses; with a gate, the plan first waits for the host to
    open it (it has then fetched the layer's misses: ft.engine.experts.gated), unless the
    host keeps the layer's slots and the table names one for every routed expert (`_gated_slots`).
    uses (a device counter): += the distinct experts computed from a slot. Hybrid on gates
    (in_place.share): an expert the table marks ON_CPU is skipped where the host opened the
    gate with CPU_SHARE (the CPU's sum of the layer is written; share.shared says so to the
    sum), else read in place like any miss (a gate that never opened: the result stays exact)."""
    P, K = ids.numel(), ids.shape[1]  # noqa: N806
    if in_place is None:  # its operands are never read: stand-ins
        count, ready, num_slots, code_base, wait, gate = ids, ids, 0, 0, False, None
    else:
        count, ready, wait = in_place.misses, in_place.ready, in_place.wait
        num_slots, code_base, gate = in_place.num_slots, in_place.code_base, in_place.gate
    assert gate is None or table is not None, "a gate guards a slot table"
    # without a kept flag, the gate stands for it: an open gate lets the layer go as well
    kept = gate if gate is None or in_place.kept is None else in_place.kept
    cpu = None if in_place is None or in_place.share is None else in_place.share.shared
    assert cpu is None or gate is not None, "the CPU's share comes with its gate"
    _plan_kernel[(1,)](
        ids, weights, table if table is not None else ids, tok, slot, weight, block_start,
        block_slot, row_of, count, uses if uses is not None else ids, ready,
        gate if gate is not None else ids, kept if kept is not None else ids,
        cpu if cpu is not None else ids, P, num_slots, code_base, ids.stride(0), K=K,
        BP=triton.next_power_of_2(P), TABLE=table is not None, IN_PLACE=in_place is not None,
        WAIT=wait, GATE=gate is not None, USES=uses is not None, CPU=cpu is not None,
    )  # fmt: skip
