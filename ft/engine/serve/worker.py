"""The engine thread of `ft serve`: one named thread drives LLMEngine.step() for all requests.

The engine is not thread-safe, so only this thread touches it. Requests arrive through a
thread-safe inbox; each token goes back to its request's asyncio queue through
loop.call_soon_threadsafe. With nothing to do the thread blocks on the inbox (no busy-wait);
with work in flight it drains the inbox between steps, so new requests join the running batch
(continuous batching) and aborts free their KV before the next step.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from ft.engine.cpu.threads import name_os_thread
from ft.errors import FtError
from ft.log import get_logger

log = get_logger("ft.serve")

ENGINE_THREAD_NAME = "ft-engine"
RATE_WINDOW_S = 10.0  # the rate gauges of /metrics cover the last 10 s of wall time


def _start_torch_team() -> None:
    """Have torch start this thread's OpenMP worker team now (a parallel op does it)."""
    try:
        import torch

        torch.ones(1 << 20).sum()
    except Exception:
        pass  # only the names of those threads are at stake


@dataclass(frozen=True)
class TokenEvent:
    """One engine output for one request, as its asyncio side sees it."""

    token_id: int | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500


def _wake(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """One wake-up of `loop` delivers every (queue, event) of a step: one syscall, not one each."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
        pass


def _put_all(items: list) -> None:
    for target, event in items:
        target.put_nowait(event)


class RequestHandle:
    """A request's end of the pipe: the engine thread fills `queue`, the HTTP handler drains it."""

    def __init__(self, prompt_ids: list[int], params: Any, loop: asyncio.AbstractEventLoop):
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.submitted_at = time.perf_counter()
        self.seq_id: int | None = None  # set by the engine thread
        self.has_first_token = False
        self.closed = False  # finished, failed or aborted: no more events

    def push(self, event: TokenEvent) -> None:
        """Hand one event to the request's event loop (from any thread)."""
        _wake(self.loop, [(self.queue, event)])

    async def events(self):
        """Yield this request's events until the one that finishes it."""
        while True:
            event = await self.queue.get()
            yield event
            if event.finished:
                return


class EngineWorker:
    """Owns the engine thread; every method but `_run` and its helpers is safe from any thread."""

    def __init__(self, engine: Any, metrics: Any = None):
        self.engine = engine
        self.metrics = metrics  # ServerMetrics: observe_ttft, count_token, count_finished
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, RequestHandle] = {}  # seq_id -> handle, engine thread only
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._rate_lock = threading.Lock()
        self._rate_points: collections.deque = collections.deque()
        self.stats = engine.stats  # last snapshot, replaced after every step
        self.num_running = 0
        self.num_waiting = 0
        self._stopping = False

    # -- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: RequestHandle) -> None:
        if self._stopping:
            self._fail(handle, "the server is shutting down", status=503)
        else:
            self._inbox.put(("add", handle))

    def abort(self, handle: RequestHandle) -> None:
        if not handle.closed:
            self._inbox.put(("abort", handle))

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout_s)

    def window(self) -> tuple[Any, Any] | None:
        """(oldest, newest) stats snapshots of the last RATE_WINDOW_S seconds; None if idle."""
        horizon = time.monotonic() - RATE_WINDOW_S
        with self._rate_lock:
            recent = [stats for t, stats in self._rate_points if t >= horizon]
        return (recent[0], recent[-1]) if len(recent) > 1 else None

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        _start_torch_team()  # before the rename: torch's worker threads inherit the name
        name_os_thread(ENGINE_THREAD_NAME)  # probes read the role from /proc
        try:
            while self._drain_inbox(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except BaseException:
            log.exception("the engine thread failed; /health now answers 503")
            self._close_all(None, error="the engine thread failed")
            raise
        finally:
            self._stopping = True
            self._refuse_queued()
        self._close_all("abort", error=None)

    def _refuse_queued(self) -> None:
        """Requests that reached the inbox after the stop get a 503, never silence."""
        while True:
            try:
                command, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._fail(handle, "the server is shutting down", status=503)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; block for the first when idle. False once asked to stop."""
        while True:
            try:
                command, handle = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            if command == "add":
                self._add(handle)
            else:
                self._abort(handle)
            self._update_counts()

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.seq_id = self.engine.add_request(handle.prompt_ids, handle.params)
        except (FtError, ValueError) as exc:
            self._fail(handle, str(exc), status=400)
            return
        except Exception as exc:  # an engine bug must not take the server down
            log.exception("engine.add_request failed")
            self._fail(handle, f"engine error: {exc}", status=500)
            return
        self._live[handle.seq_id] = handle

    def _abort(self, handle: RequestHandle) -> None:
        if handle.seq_id is None or self._live.pop(handle.seq_id, None) is None:
            return  # already finished
        handle.closed = True
        try:
            self.engine.abort(handle.seq_id)
        except Exception:
            log.exception("engine.abort(%s) failed", handle.seq_id)
        handle.push(TokenEvent(None, True, "abort"))
        if self.metrics is not None:
            self.metrics.count_finished("abort")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine.step failed; failing the requests in flight")
            self._close_all(None, error=f"engine error: {exc}")
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            handle = self._live.get(out.seq_id)
            if handle is not None:
                event = self._deliver(handle, out)
                by_loop.setdefault(handle.loop, []).append((handle.queue, event))
        for loop, items in by_loop.items():
            _wake(loop, items)
        self._after_step()

    def _deliver(self, handle: RequestHandle, out: Any) -> TokenEvent:
        """Account for one engine output; the event to send its request."""
        if out.token_id is not None:
            self._count_token(handle)
        if out.finished:
            handle.closed = True
            self._live.pop(out.seq_id, None)
            if self.metrics is not None:
                self.metrics.count_finished(out.finish_reason or "stop")
        return TokenEvent(out.token_id, out.finished, out.finish_reason)

    def _count_token(self, handle: RequestHandle) -> None:
        first, handle.has_first_token = not handle.has_first_token, True
        if self.metrics is None:
            return
        if first:
            self.metrics.observe_ttft(time.perf_counter() - handle.submitted_at)
        self.metrics.count_token()

    def _after_step(self) -> None:
        self.stats = self.engine.stats
        self._update_counts()
        now = time.monotonic()
        with self._rate_lock:
            self._rate_points.append((now, self.stats))
            while now - self._rate_points[0][0] > RATE_WINDOW_S:
                self._rate_points.popleft()

    def _update_counts(self) -> None:
        running = sum(1 for h in self._live.values() if h.has_first_token)
        self.num_running, self.num_waiting = running, len(self._live) - running

    def _fail(self, handle: RequestHandle, message: str, status: int) -> None:
        handle.closed = True
        handle.push(TokenEvent(None, True, None, error=message, error_status=status))

    def _close_all(self, reason: str | None, error: str | None) -> None:
        for handle in list(self._live.values()):
            try:
                self.engine.abort(handle.seq_id)
            except Exception:
                pass  # the engine may already be broken; the client still gets its answer
            if error is None:
                handle.closed = True
                handle.push(TokenEvent(None, True, reason))
            else:
                self._fail(handle, error, status=500)
        self._live.clear()
        self._update_counts()
