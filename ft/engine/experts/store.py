"""The host expert store: every routed expert of every MoE layer, in host memory.

Layout (the contract; docs/formats.md): per MoE layer a bank, part name -> tensor with a
leading dim of E experts; the parts are the expert format's (`bf16`: `w13` [E, 2I, D] with rows
0..I-1 gate / w1 and I..2I-1 up / w3, `w2` [E, D, I]; quantised formats add their scales).
None for dense layers. Pinned when CUDA is present so copies into device slots can be
asynchronous.

In memory an expert's parts lie side by side, in one block a row of the layer's `blocks`
([E, block bytes]); each part is a view, each expert's part contiguous. A cache slot is laid
out the same way (`expert_blocks`), so an expert crosses PCIe in one copy: three copies of its
parts cost ~5 us of the link more an expert (on the H200 box). Resident's
device copy of a layer is its blocks, copied whole, read through the same views (`block_views`).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from ft.engine.formats import ExpertFormat, Part, Parts, get_format

ALIGN = 64  # bytes: each part's start in a block, and the block's size, a multiple of it


def expert_blocks(count: int, parts: dict[str, Part], **alloc) -> tuple[torch.Tensor, Parts]:
    """-> (blocks [count, block bytes] uint8, part name -> a view [count, *shape] of them):
    `count` experts' parts side by side, each expert's part contiguous and aligned; `alloc`:
    torch.empty's device or pin_memory. Host blocks that are not pinned lie on huge pages
    (huge_page_bytes)."""
    size = sum(_aligned(part.nbytes) for part in parts.values())
    if alloc.get("pin_memory") or torch.device(alloc.get("device") or "cpu").type != "cpu":
        blocks = torch.empty(count, size, dtype=torch.uint8, **alloc)
    else:
        blocks = huge_page_bytes(count * size).view(count, size)
    return blocks, block_views(blocks, parts)


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory (uint8) from an anonymous mapping advised onto transparent
    huge pages before anything touches it, its start on a huge page's boundary. The CPU pool
    streams experts with one TLB entry per 2 MiB instead of per 4 KiB (a bf16 row of 2048 is a
    page): two threads of the 2-core EPYC VM read bf16 experts at 27.2-27.8 GB/s against
    20.4-20.5 on 4 KiB pages, int8 at 22.6-22.8 against 18.3 (one token, 8 experts a call). Where
    the kernel's THP is "never" the advice is ignored and the pages stay 4 KiB. Pinned memory
    (CUDA's page-locked allocator) is allocated elsewhere."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def block_views(blocks: torch.Tensor, parts: dict[str, Part]) -> Parts:
    """Part name -> a view [count, *shape] of `blocks` ([count, block bytes] uint8, laid out by
    expert_blocks): so a copy of the blocks, anywhere, is read as the same parts."""
    views, at, count = {}, 0, len(blocks)
    for name, part in parts.items():
        views[name] = blocks[:, at : at + part.nbytes].view(part.dtype).view(count, *part.shape)
        at += _aligned(part.nbytes)
    return views


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass
class HostExpertStore:
    banks: list[Parts | None]  # per decoder layer: part -> [E, ...], or None (dense layer)
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype  # the engine's float dtype: bf16-format parts and every compute
    fmt: str = "bf16"  # expert format (ft.engine.formats)
    # per decoder layer: [E, block bytes], the banks' memory (expert_blocks), or None (dense
    # layer, or banks made some other way: then copied part by part)
    blocks: list[torch.Tensor | None] | None = None

    @classmethod
    def allocate(
        cls, num_layers, moe_layers, num_experts, hidden, inter, dtype, fmt: str = "bf16"
    ) -> HostExpertStore:
        pin = torch.cuda.is_available()  # pinned pages let the copy stream run asynchronously
        form = get_format(fmt)
        form.check_shape(hidden, inter)
        parts = form.parts(hidden, inter, dtype)
        banks: list[Parts | None] = [None] * num_layers
        blocks: list[torch.Tensor | None] = [None] * num_layers
        for layer in moe_layers:
            blocks[layer], banks[layer] = expert_blocks(num_experts, parts, pin_memory=pin)
        return cls(banks, num_experts, hidden, inter, dtype, fmt, blocks)

    @property
    def format(self) -> ExpertFormat:
        return get_format(self.fmt)

    @property
    def parts(self) -> dict[str, Part]:
        """Each part's shape and dtype for ONE expert (what a cache slot holds)."""
        return self.format.parts(self.hidden_size, self.intermediate_size, self.dtype)

    def expert(self, layer: int, expert: int) -> Parts:
        """One expert's parts (views of the bank)."""
        return {name: t[expert] for name, t in self.banks[layer].items()}

    def dequantize(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's experts as float (w13 [E, 2I, D], w2 [E, D, I]) in `dtype` (a copy,
        except bf16 parts already in `dtype`)."""
        return self.format.dequantize(self.banks[layer], dtype)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, b in enumerate(self.banks) if b is not None]

    @property
    def total_experts(self) -> int:
        return self.num_experts * len(self.moe_layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert, every part: what a cache miss copies."""
        return self.format.expert_bytes(self.hidden_size, self.intermediate_size, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.total_experts
