"""Batched expert compute over (token, slot) pairs: one gate/up and one down pass for a whole
layer, reading weights straight from a slot bank: part name -> [N, ...], the expert format's
parts (`bf16`: w13 [N, 2I, D], w2 [N, D, I]; see ft.engine.formats).

The work list is `PairBlocks`: the layer's pairs sorted by slot, cut into blocks of `block_m`
rows that each belong to one slot. Block b covers pair rows [start[b], start[b] + block_m) that
carry slot `block_slot[b]` (-1: nothing to do). Two builders fill it: `blocks_on_device` from
the router's ids with no host sync (decode), and `blocks_from_groups` from host-known expert
groups (prefill, offload chunks, hybrid). Two backends run it: Triton (CUDA; dequantises in
registers) and torch (CPU, or where Triton is missing; dequantises a block's slot to x's dtype,
then multiplies); `ref_moe_pairs` is the one-pair-at-a-time reference for tests.

Legend: T = tokens, K = experts per token, P = pairs, NB = blocks, N = slots, D = hidden,
I = expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.engine.formats import get_format
from ft.engine.kernels.codes import CPU_SHARE, ON_CPU

MIN_BLOCK_M = 16  # tl.dot needs 16 rows at least
MAX_DEVICE_PAIRS = 128  # above this (prefill), rows of one slot may outgrow a block: group on host


@dataclass
class PairBlocks:
    tok: torch.Tensor  # [P] token (row of x) of each pair, sorted by slot
    slot: torch.Tensor  # [P] int32 slot of each pair (-1: skip)
    weight: torch.Tensor  # [P] routing weight
    block_start: torch.Tensor  # [NB] int32 first pair row of each block
    block_slot: torch.Tensor  # [NB] int32 slot of each block (-1: inactive)
    block_m: int  # pair rows per block, a power of two >= 16
    # [P] int32 the row each routed pair lands on, in routing order (pair t * K + k: token t's
    # k-th expert); decode's plans give it, so each token sums its K rows (`reduce_pairs`)
    row_of: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.tok.shape[0]


@dataclass(frozen=True)
class CpuShare:
    """Hybrid on device gates: the CPU's sum of a layer's experts the table marks ON_CPU."""

    rows: torch.Tensor  # [B_max, D] float32, written by the host (pinned: read in place)
    # [1] int32 on the device, set by the plan: 1 where the host opened the gate with CPU_SHARE
    # (the rows hold the sum, and the marked experts are skipped), 0 where they are read in place
    shared: torch.Tensor


@dataclass(frozen=True)
class InPlace:
    """Decode on gates: where a routed expert's slot is not ready, the expert is read in place
    from row `expert` of the host bank (slot `num_slots + expert` of the work list; see
    moe_pairs) and counted in `misses`. A slot is ready once `ready[slot]` holds the expert's
    code, `code_base + expert`, which the copy engine writes there behind the expert's data.
    On CUDA the plan waits a bounded time for a slot whose copy is still queued (`wait`), and,
    given a `gate` (device gates), first for the host to open it: the host has then queued the
    copies of the layer's misses and named their slots in the table (ft.engine.experts.gated),
    unless the layer is `kept` and the table names a slot for each of its routed
    experts. The torch path waits for neither."""

    num_slots: int
    misses: torch.Tensor  # [1] int64, on the device
    ready: torch.Tensor  # [N] int32: the code of the expert each slot's data holds
    code_base: int  # layer * experts per layer
    wait: bool = True
    # [1] int32 the device reads in pinned memory: nonzero once the host has opened the layer
    gate: torch.Tensor | None = None
    # [1] int32 in pinned memory, with a gate: nonzero while the host keeps the layer's slots
    # (takes none of them for the rest of the step); the plan then goes on without the gate
    # where the table names a slot for every routed expert
    kept: torch.Tensor | None = None
    share: CpuShare | None = None  # with a gate: hybrid's CPU share of the layer


def block_m_for(rows: int) -> int:
    return max(MIN_BLOCK_M, 1 << max(rows - 1, 0).bit_length())


def blocks_on_device(
    pair_slots: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None = None
) -> PairBlocks:
    """From per-pair slots [T, K] (on the device) and weights [T, K]; no host sync. One block
    per pair row; the first row of each slot's run owns the block and all the run (P <= block_m
    so a run always fits). Pairs are ordered by `experts` [T, K] when given (slots of a cache:
    each token then sums its experts in the same order as resident, bit for bit on the CPU),
    else by slot."""
    top_k, flat = pair_slots.shape[1], pair_slots.flatten().to(torch.int32)  # [P]
    key = flat if experts is None else experts.flatten()
    sorted_key, order = torch.sort(key, stable=True)
    previous = F.pad(sorted_key[:-1], (1, 0), value=-2)
    sorted_slots = flat[order] if experts is not None else sorted_key
    first = torch.where(sorted_key != previous, sorted_slots, -1)  # [P] a block per run
    starts = torch.arange(flat.shape[0], dtype=torch.int32, device=flat.device)
    row_of = torch.empty_like(starts).scatter_(0, order, starts)  # order's inverse
    return PairBlocks(
        tok=order // top_k, slot=sorted_slots, weight=weights.flatten()[order],
        block_start=starts, block_slot=first, block_m=block_m_for(flat.shape[0]), row_of=row_of,
    )  # fmt: skip


def plan_blocks(
    ids, weights, table=None, backend: str = "torch", in_place: InPlace | None = None,
    uses: torch.Tensor | None = None,
) -> PairBlocks:  # fmt: skip
    """The decode work list from the router's ids [T, K] and weights [T, K], no host sync:
    slot = table[expert] (a cache's slot table row) or the expert id itself (table None);
    with `in_place` (decode on gates), an expert whose slot is none or not ready gets its row
    of the host store instead; `uses` (a counter on the device) += the distinct experts it
    computes from a slot. One Triton program on CUDA; blocks_on_device's torch ops elsewhere
    (the same list; they do not wait for a queued copy)."""
    if backend != "triton":
        slots = ids if table is None else table[ids]
        if in_place is not None:
            code = ids.to(torch.int32) + in_place.code_base
            ready = (slots >= 0) & (in_place.ready[slots.clamp(min=0)] == code)
            marked = slots == ON_CPU
            slots = torch.where(ready, slots, ids.to(slots.dtype) + in_place.num_slots)
            if in_place.share is not None:  # as the kernel's, with the gate already open
                shared = in_place.gate[0] == CPU_SHARE
                in_place.share.shared.copy_(shared.to(torch.int32).reshape(1))
                slots = torch.where(marked & shared, -1, slots)
        blocks = blocks_on_device(slots, weights, None if table is None else ids)
        if in_place is not None:
            in_place.misses.add_((blocks.block_slot >= in_place.num_slots).sum())
        if uses is not None:
            uses.add_((blocks.block_slot >= 0).sum())
        return blocks
    from ft.engine.kernels.fused import plan_pairs

    p, dev = ids.numel(), ids.device
    tok = torch.empty(p, dtype=torch.long, device=dev)
    int32 = dict(dtype=torch.int32, device=dev)
    slot, start, block_slot, row_of = (torch.empty(p, **int32) for _ in "ssbr")
    weight = torch.empty(p, dtype=weights.dtype, device=dev)
    plan_pairs(ids, weights, table, tok, slot, weight, start, block_slot, row_of, in_place, uses)
    return PairBlocks(tok, slot, weight, start, block_slot, block_m_for(p), row_of)


def blocks_from_groups(groups, slots: list[int], device) -> PairBlocks:
    """From expert groups (rows and weights on the device, sizes known on the host) and the
    cache slot of each group; the block list is built on the host and sent in one copy."""
    sizes = [g.rows.shape[0] for g in groups]
    block_m = MIN_BLOCK_M if max(sizes, default=0) <= MIN_BLOCK_M else 64
    pair_slot, starts, owners, offset = [], [], [], 0
    for size, slot in zip(sizes, slots, strict=True):
        pair_slot += [slot] * size
        starts += range(offset, offset + size, block_m)
        owners += [slot] * len(range(0, size, block_m))
        offset += size
    meta = torch.tensor(pair_slot + starts + owners, dtype=torch.int32)
    if torch.device(device).type == "cuda":  # pinned + non_blocking: the host does not wait
        meta = meta.pin_memory().to(device, non_blocking=True)
    p, nb = len(pair_slot), len(starts)
    return PairBlocks(
        tok=torch.cat([g.rows for g in groups]), slot=meta[:p],
        weight=torch.cat([g.weights for g in groups]),
        block_start=meta[p : p + nb], block_slot=meta[p + nb :], block_m=block_m,
    )  # fmt: skip


def moe_pairs(x, bank: dict, blocks: PairBlocks, backend: str, fmt: str, host=None) -> torch.Tensor:
    """-> y [P, D] float32: weight * FFN_slot(x[tok]) per pair row (rows whose slot is -1 are
    not computed: undefined with Triton, 0 with torch; reduce_pairs leaves them out).
    `bank`: part name -> [N, ...] in expert format `fmt`; `host` (reads in place): a bank
    of the same format, part -> [E, ...] in pinned host memory: slot N + e reads its expert e
    there, in place."""
    if backend == "triton":
        from ft.engine.kernels.moe import triton_moe_pairs

        return triton_moe_pairs(x, bank, blocks, fmt, host)
    return torch_moe_pairs(x, bank, blocks, fmt, host)


def reduce_pairs(
    blocks: PairBlocks, y: torch.Tensor, tokens: int, dtype=torch.float32, backend: str = "torch",
    share: CpuShare | None = None,
) -> torch.Tensor:  # fmt: skip
    """-> [T, D] in `dtype`: each token's pair outputs y [P, D] summed in float32, rows whose
    slot is -1 left out (moe_pairs leaves them unwritten), plus hybrid's CPU share where the
    plan set its flag. Triton, where the plan says where each token's pairs are (`row_of`): one
    launch, each token's K rows in routing order; else torch's index_add_ (the same order for
    every strategy on the CPU, so resident and offload agree bit for bit there)."""
    if backend == "triton" and blocks.row_of is not None:
        from ft.engine.kernels.moe import triton_reduce_pairs

        return triton_reduce_pairs(y, blocks.row_of, blocks.slot, tokens, dtype, share)
    y = torch.where((blocks.slot >= 0)[:, None], y, 0.0)
    acc = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, blocks.tok, y)
    if share is not None and int(share.shared[0]):  # a host sync: the torch path's
        acc += share.rows[:tokens].to(acc.device)
    return acc.to(dtype)


def torch_moe_pairs(x, bank: dict, blocks: PairBlocks, fmt: str, host=None) -> torch.Tensor:
    """The torch backend: one small matmul pair per active block (host loop over blocks). A
    block's live rows are one contiguous run, as pairs are sorted by slot. The block's slot is
    dequantised to x's dtype first (bf16 weights in x's dtype: no copy); slot N + e, with a
    host bank, is that bank's expert e."""
    form, num_slots = get_format(fmt), bank["w13"].shape[0]
    y = torch.zeros(blocks.num_pairs, x.shape[1], dtype=torch.float32, device=x.device)
    slots = blocks.slot.tolist()  # free on the CPU; a sync on CUDA (Triton is the CUDA path)
    for start, slot in zip(blocks.block_start.tolist(), blocks.block_slot.tolist(), strict=True):
        if slot < 0:
            continue
        end = start
        while end < min(start + blocks.block_m, len(slots)) and slots[end] == slot:
            end += 1
        if slot < num_slots:
            w13, w2 = form.slot_weights(bank, slot, x.dtype)  # [2I, D], [D, I]
        else:
            w13, w2 = form.slot_weights(host, slot - num_slots, x.dtype)  # read in place
            w13, w2 = w13.to(x.device), w2.to(x.device)  # (CUDA without Triton)
        gate, up = F.linear(x[blocks.tok[start:end]], w13).chunk(2, dim=-1)  # [n, I] each
        h = F.linear(F.silu(gate) * up, w2)  # [n, D]
        y[start:end] = h * blocks.weight[start:end, None].to(h.dtype)
    return y


def ref_moe_pairs(x, bank: dict, tok, slot, weight, fmt: str = "bf16") -> torch.Tensor:
    """Reference: out [T, D] float32 = sum over pairs of weight * FFN_slot(x[tok]), one pair
    at a time in float32 from the slot's weights dequantised to float32; pairs with slot -1
    are skipped."""
    w13, w2 = get_format(fmt).dequantize(bank, torch.float32)  # [N, 2I, D], [N, D, I]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t, s, w in zip(tok.tolist(), slot.tolist(), weight.float().tolist(), strict=True):
        if s < 0:
            continue
        gate, up = (w13[s] @ x[t].float()).chunk(2)
        out[t] += w * (w2[s] @ (F.silu(gate) * up))
    return out


def pick_backend(device: torch.device | str) -> str:
    """'triton' on CUDA when Triton imports, else 'torch'."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"
