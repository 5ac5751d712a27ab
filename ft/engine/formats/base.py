"""What an expert format is: its parts per expert (the bank layout; docs/formats.md),
how float experts become those parts, how they become float again (a whole expert, or the block
of I rows one CPU MoE task multiplies), and how the parts are named in a checkpoint.

A bank is a dict part name -> tensor with a leading dim of experts (host store) or slots (device
cache); the parts of ONE expert are the same dict indexed at that expert. Every format has the
parts `w13` [2I rows, ...] (rows 0..I-1 gate, I..2I-1 up) and `w2` [D rows, ...] (down), plus
its scales. Checkpoints name each projection on its own (`gate_proj`, `up_proj`, `down_proj`);
a w13 part is gate's tensor stacked on up's.

Legend: E = experts, D = hidden, I = expert intermediate, R x C = one projection's out x in,
n = rows dequantised, s = a block of I.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ft.errors import FtError

PROJECTIONS = ("gate", "up", "down")  # w13 = gate over up; w2 = down
E4M3 = torch.float8_e4m3fn  # fp8_block's weights, nvfp4's block scales
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(E4M3).float()  # byte -> value
E4M3_TABLE = E4M3_VALUES.numpy()  # the same, for the CPU kernels


@dataclass(frozen=True)
class Part:
    shape: tuple[int, ...]  # per expert
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Parts = dict[str, torch.Tensor]


class ExpertFormat:
    """One expert format. Subclasses set the class attributes and the five abstract methods."""

    name: str = "?"
    quantized: bool = True
    cpu_path: bool = True  # the CPU MoE executor computes it (run_slice dequantises a block)
    no_cpu_note: str | None = None  # why not, in the bandwidth profile's words
    align: int = 1  # CPU blocks of I start and end on multiples of this (nvfp4: its 16-groups)
    # checkpoint tensor suffix of each projection -> bank part suffix ("" is w13 / w2 itself)
    tensors: dict[str, str] = {"weight": ""}
    constants: dict[str, float] = {}  # written per projection for readers that want them; ignored

    # -- the format's own arithmetic (abstract) ----------------------------------------------------

    def parts(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, Part]:
        """Each part's per-expert shape and dtype (`dtype`: the checkpoint's float dtype)."""
        raise NotImplementedError

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Parts:
        """Float w13 [..., 2I, D] and w2 [..., D, I] (any leading dims, e.g. E) -> parts."""
        raise NotImplementedError

    def w13_rows(self, parts: Parts, r0: int, r1: int, out: torch.Tensor) -> None:
        """out [..., r1 - r0, D] (contiguous, any float dtype) = rows r0..r1 of w13, in float."""
        raise NotImplementedError

    def w2_cols(self, parts: Parts, c0: int, c1: int, out: torch.Tensor) -> None:
        """out [..., D, c1 - c0] (contiguous) = columns c0..c1 of w2, in float."""
        raise NotImplementedError

    def checkpoint_shape(self, suffix: str, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of `{proj}.{suffix}` in a checkpoint for a projection of R x C float weights."""
        raise NotImplementedError

    def rows_dot(self, parts: Parts, name: str, r0: int, r1: int, c0: int, x, out) -> None:
        """Quantised formats, the CPU MoE pool's compute: out [n, r1 - r0] = x [n, cols] @
        W[r0:r1, c0:c0 + cols].T, W the part `name` ("w13" or "w2") of ONE expert, read from its
        codes (ft.engine.cpu.kernels); x, out: float32 numpy arrays, C-contiguous."""
        raise NotImplementedError

    # -- derived ---------------------------------------------------------------------------------

    def expert_bytes(self, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one expert, every part: what a cache miss copies."""
        return sum(p.nbytes for p in self.parts(hidden, inter, dtype).values())

    def check_shape(self, hidden: int, inter: int) -> None:
        """FtError naming the shape where this format cannot hold it."""

    def inter_of(self, parts: Parts) -> int:
        return parts["w13"].shape[-2] // 2  # w13 has 2I rows in every format

    def dequantize(self, parts: Parts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (w13 [..., 2I, D], w2 [..., D, I]) in `dtype`: a whole expert, or a whole bank."""
        inter, lead = self.inter_of(parts), parts["w13"].shape[:-2]
        hidden = parts["w2"].shape[-2]
        w13 = torch.empty(*lead, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(*lead, hidden, inter, dtype=dtype)
        self.w13_rows(parts, 0, 2 * inter, w13)
        self.w2_cols(parts, 0, inter, w2)
        return w13, w2

    def dequant_block(
        self, parts: Parts, lo: int, hi: int, gu: torch.Tensor, down: torch.Tensor
    ) -> None:
        """One expert's block [lo, hi) of I: gu [2s, D] = gate rows over up rows, down [D, s]."""
        s, inter = hi - lo, self.inter_of(parts)
        self.w13_rows(parts, lo, hi, gu[:s])
        self.w13_rows(parts, inter + lo, inter + hi, gu[s:])
        self.w2_cols(parts, lo, hi, down)

    def slot_weights(self, bank: Parts, slot: int, dtype: torch.dtype):
        """(w13 [2I, D], w2 [D, I]) of one bank slot in `dtype`, for the torch backend."""
        return self.dequantize({k: v[slot] for k, v in bank.items()}, dtype)

    # -- checkpoints -----------------------------------------------------------------------------

    def quantization_config(self) -> dict | None:
        """config.json's `quantization_config` for a checkpoint whose routed experts are in it."""
        return None

    def matches(self, config: dict | None) -> bool:
        """Whether a checkpoint's `quantization_config` describes this format."""
        raise NotImplementedError

    def projections(self, parts: Parts) -> dict[str, dict[str, torch.Tensor]]:
        """One expert's parts as its checkpoint tensors: proj -> suffix -> view of the bank
        (in the bank's shape; reshape to checkpoint_shape to write, the other way to read)."""
        out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in PROJECTIONS}
        for suffix, part in self.tensors.items():
            w13, w2 = parts["w13" + part], parts["w2" + part]
            half = w13.shape[0] // 2
            out["gate"][suffix], out["up"][suffix] = w13[:half], w13[half:]
            out["down"][suffix] = w2
        return out

    def projection_shape(self, proj: str, hidden: int, inter: int) -> tuple[int, int]:
        """(rows, cols) of a projection's float weight: gate/up [I, D], down [D, I]."""
        return (hidden, inter) if proj == "down" else (inter, hidden)


def code_table(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`codes` (a table: code -> value, or code -> k values) in `dtype`, made once per dtype;
    k values are viewed as one integer of their bytes, so a lookup moves one element."""
    key = (codes.data_ptr(), dtype)
    table = _TABLES.get(key)
    if table is None:
        table = codes.to(dtype)
        if table.dim() == 2:  # [256, k] -> [256] of k * itemsize bytes each
            table = table.view(_WORD[table.shape[1] * dtype.itemsize]).view(-1)
        _TABLES[key] = table
    return table


_TABLES: dict = {}
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def decode_into(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """out (contiguous) = table[codes], one gather straight into `out`: on the CPU a table
    lookup is several times faster than torch's element-wise float8 conversion."""
    index = codes.reshape(-1).to(torch.int32)
    torch.index_select(table, 0, index, out=out.view(table.dtype).view(-1))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_multiple(fmt: str, hidden: int, inter: int, k: int) -> None:
    if hidden % k or inter % k:
        raise FtError(
            f"expert format {fmt} needs hidden and expert intermediate sizes that are multiples "
            f"of {k}, got hidden {hidden}, intermediate {inter}"
        )
