"""Device gates: decode's whole step queued as one graph that waits on the device at each MoE
layer for the host's stop (offload, hybrid, CUDA graphs; FT_DECODE_GATES=1 turns them on).

Without gates each MoE layer is a ping-pong (ft.engine.graphs.run_step): the GPU runs a stretch
to the layer's routing, then idles while the host wakes from the ids' sync, does the cache's
bookkeeping, copies the slot table row and launches the next stretch's graph (~115 us a layer on
the H200 box, against ~100 us of kernels: docs/perf.md). With gates the host launches the step
once, and serves its stops while it runs (`run_gated_step`):

    stretch k       ... cut k's routing -> `signal`: the stop rows into pinned host memory
    host, stop k    poll the rows -> prepare (misses' copies, slot table row on the host)
                    -> `open` gate k -> prefetch the guesses of the next cuts
    stretch k+1     `wait` at gate k (one program spinning) -> take cut k's slot table row
                    -> cut k's experts -> ... cut k+1's routing -> `signal`

so the GPU waits for the poll and the bookkeeping only: no sync's wake-up, copy op or launch.
Measured on the H200 box (docs/perf.md, round O) the launches went (0.6 us a layer) but the step
did not shorten at batch 1: each layer then waits for its experts' copies instead, so the gates
are off by default.

Host and device meet in pinned host memory that kernels read and write through its device
address (unified addressing); the protocol needs no memory fences:
  - rows: the host keeps the buffer at -1 between stops; `signal` writes the rows (ids >= 0);
    the host polls until no -1 is left, reads them, and refills -1 before it opens the gate
    (its stores reach the device in order), so the next signal cannot meet stale rows;
  - gates: counts that only grow. The host counts the openings of gate k and publishes the
    count in go[k] (pinned), or from a stream in go_device[k]; passed[k] (device memory) is the
    device's count of passes; gate k waits while both go[k] and go_device[k] are <= passed[k].
    Nothing is reset, so no write can overtake another.
Where the compute must wait for copies (a miss, a prefetch still in flight, hybrid's CPU share),
the host opens the gate from the copy stream, behind them: a copy of the count into go_device[k]
queued there; otherwise it writes go[k] itself. No kernel may be launched while a gate spins:
CUDA loads a kernel's module on its first launch, and that load waits for the device to idle, so
a spinning gate and a first launch wait for each other for ever (the stream's open is a copy).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from ft.errors import FtError

POLL_TIMEOUT_S = 60.0  # the device owes the host a stop's rows: past this, it is stuck


@triton.jit
def _wait_kernel(go, go_device, passed, table_host, table_device, E, BLOCK: tl.constexpr):
    """Spin until the host's count of openings (either copy of it) exceeds the passes, count this
    pass, then copy the cut's slot table row [E] from the host's table into the device's."""
    want = tl.load(passed) + 1
    opened = tl.maximum(tl.load(go, volatile=True), tl.load(go_device, volatile=True))
    while opened < want:
        opened = tl.maximum(tl.load(go, volatile=True), tl.load(go_device, volatile=True))
    tl.store(passed, want)
    cols = tl.arange(0, BLOCK)
    row = tl.load(table_host + cols, mask=cols < E, volatile=True)
    tl.store(table_device + cols, row, mask=cols < E)


@triton.jit
def _signal_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


class _DeviceView:
    """A CUDA-array-interface view of pinned host memory: with unified addressing, the pinned
    pages' host address is also their device address."""

    TYPESTR = {torch.int32: "<i4", torch.int64: "<i8"}

    def __init__(self, host: torch.Tensor):
        assert host.is_pinned() and host.is_contiguous()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": self.TYPESTR[host.dtype],
            "data": (host.data_ptr(), False), "version": 3, "strides": None,
        }  # fmt: skip


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned host memory `host` (same bytes: kernels read and write it over
    PCIe); keep `host` alive while the view is used."""
    return torch.as_tensor(_DeviceView(host), device="cuda")


def _wait(go, go_device, passed, table_host_row, table_device_row) -> None:
    experts = table_device_row.shape[0]
    _wait_kernel[(1,)](
        go, go_device, passed, table_host_row, table_device_row, experts,
        BLOCK=triton.next_power_of_2(experts),
    )  # fmt: skip


def _signal(stop: torch.Tensor, rows) -> None:
    n = stop.numel()
    _signal_kernel[(1,)](stop, rows, n, BLOCK=triton.next_power_of_2(n))


class StopGates:
    """The gates and stop rows of one decode graph set: `num_cuts` gates, rows for up to
    `max_batch` sequences of `columns` ids, and the cache's slot table (pinned on the host,
    [layers, E]) that a gate copies its cut's row of into the device's."""

    def __init__(self, num_cuts: int, max_batch: int, columns: int, table_host, table_device):
        device = table_device.device
        mapped = device.type == "cuda"  # CPU tensors stand in for tests (Triton's interpreter)
        self.columns = columns
        self.go = torch.zeros(num_cuts, dtype=torch.int64, pin_memory=mapped)
        self.rows = torch.full((max_batch * columns,), -1, dtype=torch.int64, pin_memory=mapped)
        self.passed = torch.zeros(num_cuts, dtype=torch.int64, device=device)
        self.go_device = torch.zeros(num_cuts, dtype=torch.int64, device=device)
        self._counts = torch.zeros(num_cuts, dtype=torch.int64, pin_memory=mapped)  # its source
        self._count_items = self._counts.numpy()
        self._table_host, self._table_device = table_host, table_device
        view = device_view if mapped else (lambda t: t)
        self._go_view, self._rows_view = view(self.go), view(self.rows)
        self._table_view = view(table_host)
        self._go_items, self._rows_items = self.go.numpy(), self.rows.numpy()
        self._opened = [0] * num_cuts

    # -- queued on the device (captured in the stretches' graphs) --------------------------------

    def wait(self, k: int, layer: int) -> None:
        """Stretch k+1's first work: wait until the host opens gate k, then take the slot table
        row of cut k (MoE layer `layer`)."""
        table_host, table_device = self._table_view[layer], self._table_device[layer]
        _wait(self._go_view[k:], self.go_device[k:], self.passed[k:], table_host, table_device)

    def signal(self, stop: torch.Tensor) -> None:
        """Stretch k's last work: its stop rows [b, columns] (contiguous) to the host."""
        _signal(stop, self._rows_view)

    def rehearsal(self) -> Rehearsal:
        return Rehearsal(self)

    # -- the host's side ------------------------------------------------------------------------

    def rows_of(self, batch: int, timeout: float = POLL_TIMEOUT_S) -> list[list[int]]:
        """The stop rows the device signals next, [batch][columns]: the host waits for them
        here (a spin on pinned memory: no driver call), then clears them for the next."""
        flat = self._rows_items[: batch * self.columns]
        polls, deadline = 0, time.monotonic() + timeout
        while flat[-1] < 0 or (flat < 0).any():
            polls += 1
            if polls % 256 == 0:  # now and then, let other Python threads have the GIL
                time.sleep(0)
                if time.monotonic() > deadline:
                    raise FtError(f"decode: no routing ids from the device in {timeout:.0f} s")
        rows = flat.reshape(batch, self.columns).tolist()
        flat.fill(-1)
        return rows

    def open(self, k: int, stream: torch.cuda.Stream | None = None) -> None:
        """Let stretch k+1 pass gate k: now, or once `stream`'s queued work (the copies the
        stretch reads) is done."""
        self._opened[k] += 1
        if stream is None:
            self._go_items[k] = self._opened[k]
            return
        # the pinned source is rewritten at gate k's next opening, after this copy ran (the
        # gate waited for it)
        self._count_items[k] = self._opened[k]
        with torch.cuda.stream(stream):
            self.go_device[k : k + 1].copy_(self._counts[k : k + 1], non_blocking=True)

    def abandon(self, closed) -> None:
        """A step that failed before opening these gates: open them, so the device does not
        spin for ever, and clear the rows the stretches behind them signal."""
        for k in closed:
            self.open(k)
        if self._table_device.device.type == "cuda":
            torch.cuda.synchronize(self._table_device.device)
        self._rows_items.fill(-1)


class Rehearsal:
    """The gates' kernels on spare device buffers, for the eager warm-up runs before a capture:
    they compile there (not inside the capture), pass at once and signal no one."""

    def __init__(self, gates: StopGates):
        self._table = gates._table_device
        self._go = torch.full_like(gates.passed, 2**62)  # opened "for ever"
        self._go_device = torch.zeros_like(gates.passed)
        self._passed = torch.zeros_like(gates.passed)
        self._rows = torch.empty(gates.rows.shape, dtype=torch.int64, device=self._table.device)

    def wait(self, k: int, layer: int) -> None:
        row = self._table[layer]  # onto itself: the same pointers' alignment, no change
        _wait(self._go[k:], self._go_device[k:], self._passed[k:], row, row)

    def signal(self, stop: torch.Tensor) -> None:
        _signal(stop, self._rows)
