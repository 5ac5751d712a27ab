"""The host expert store's memory: experts side by side in blocks, on transparent huge pages
where they are not pinned (the CPU pool streams them with fewer TLB misses)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ft.engine.experts.store import HUGE_PAGE, HostExpertStore, huge_page_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_host_store_lies_on_huge_pages_where_the_kernel_allows():
    store = HostExpertStore.allocate(2, [1], num_experts=8, hidden=2048, inter=768,
                                     dtype=torch.bfloat16)  # fmt: skip
    blocks = store.blocks[1]
    assert not blocks.is_pinned() or torch.cuda.is_available()
    if blocks.is_pinned():
        pytest.skip("a CUDA host: the store is page-locked by CUDA's allocator")
    assert blocks.data_ptr() % HUGE_PAGE == 0
    blocks.fill_(1)  # the first touch: the kernel places its pages now
    bank = store.banks[1]
    assert bank["w13"].data_ptr() == blocks.data_ptr()
    assert torch.all(bank["w2"][7].view(torch.uint8) == 1)
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip()})")
    assert _anon_huge_kib(blocks.data_ptr()) >= blocks.numel() // 1024 // 2  # most of it


@pytest.mark.parametrize("nbytes", [0, 1, HUGE_PAGE + 3])
def test_huge_page_bytes_are_zeroed_writable_and_aligned(nbytes):
    t = huge_page_bytes(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and int(t.sum()) == 0
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * nbytes
