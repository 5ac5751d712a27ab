"""`/metrics` of `ft serve`: Prometheus text from the engine's counters and the server's own.

The engine's cumulative counters (EngineStats) are read at scrape time from the snapshot the
engine thread takes after each step, so a scrape never touches the engine itself. Clients that
want a rate over a run (the workload client) take before/after deltas of the `_total` counters:
decode tok/s = d(ft_decode_tokens_total) / d(ft_decode_time_seconds_total).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name without _total, EngineStats field, help)
ENGINE_COUNTERS = (
    ("ft_decode_tokens", "decode_tokens", "Tokens made by decode steps (all sequences)."),
    ("ft_decode_time_seconds", "decode_time_s", "Wall time the engine spent in decode steps."),
    ("ft_prefill_tokens", "prefill_tokens", "Prompt tokens prefilled."),
    ("ft_prefill_time_seconds", "prefill_time_s", "Wall time the engine spent in prefill."),
    ("ft_expert_cache_hits", "cache_hits", "Routed expert uses served from the expert cache."),
    ("ft_expert_cache_misses", "cache_misses", "Routed expert uses that missed the cache."),
    ("ft_experts_fetched", "experts_fetched", "Experts copied from host memory into cache slots."),
    (
        "ft_experts_in_place",
        "experts_in_place",
        "Experts read in place from host memory by the device (a copy past its bound).",
    ),
    (
        "ft_expert_bytes_fetched",
        "bytes_fetched",
        "Bytes of expert weights that crossed PCIe: copied into slots or read in place.",
    ),
    (
        "ft_experts_to_cpu",
        "experts_to_cpu",
        "Expert misses the strategy handed to the CPU (hybrid), wherever they then ran.",
    ),
    ("ft_experts_cpu", "experts_cpu", "Experts computed by the pinned CPU MoE pool."),
    (
        "ft_experts_cpu_inline",
        "experts_cpu_inline",
        "Experts computed on the CPU outside the pool.",
    ),
    ("ft_engine_steps", "steps", "Engine steps run."),
)
PER_STEP_GAUGES = (
    ("ft_experts_fetched_per_step", "experts_fetched", "Experts copied into cache slots"),
    ("ft_experts_in_place_per_step", "experts_in_place", "Experts read in place from host memory"),
    ("ft_experts_cpu_per_step", "experts_cpu", "Experts computed by the CPU MoE pool"),
    ("ft_experts_cpu_inline_per_step", "experts_cpu_inline", "Experts computed outside the pool"),
)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))


class _EngineCollector(Collector):
    """Reads the worker's last stats snapshot and request counts at every scrape."""

    def __init__(self, worker: Any):
        self.worker = worker

    def collect(self):
        stats = self.worker.stats
        for name, field, doc in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, field, 0) or 0))
        yield from self._window_gauges()
        yield _gauge(
            "ft_expert_cache_hit_rate",
            "Cache hits / (hits + misses), since start.",
            _hit_rate(stats),
        )
        yield _gauge("ft_requests_running", "Requests producing tokens.", self.worker.num_running)
        yield _gauge(
            "ft_requests_waiting",
            "Requests admitted but without a first token yet.",
            self.worker.num_waiting,
        )

    def _window_gauges(self):
        """Rates over the worker's last 10 s: decode tok/s, and experts per engine step."""
        window = self.worker.window()
        old, new = window if window else (None, None)
        yield _gauge("ft_decode_tokens_per_second", "Engine decode tok/s over the last 10 s.",
                     _ratio(old, new, "decode_tokens", "decode_time_s"))  # fmt: skip
        for name, field, what in PER_STEP_GAUGES:
            yield _gauge(name, f"{what} per engine step, over the last 10 s.",
                         _ratio(old, new, field, "steps"))  # fmt: skip


def _ratio(old: Any, new: Any, top: str, bottom: str) -> float:
    """d(top) / d(bottom) between two stats snapshots; 0 without both or without change."""
    if old is None or new is None:
        return 0.0
    d_bottom = float(getattr(new, bottom, 0) or 0) - float(getattr(old, bottom, 0) or 0)
    d_top = float(getattr(new, top, 0) or 0) - float(getattr(old, top, 0) or 0)
    return d_top / d_bottom if d_bottom > 0 else 0.0


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _hit_rate(stats: Any) -> float:
    hits = float(getattr(stats, "cache_hits", 0) or 0)
    misses = float(getattr(stats, "cache_misses", 0) or 0)
    return hits / (hits + misses) if hits + misses else 0.0


class ServerMetrics:
    """The server's registry (its own, not prometheus-client's global one)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series: process-wide, and this is the server's
        self.registry = CollectorRegistry()
        self._ttft = Histogram(
            "ft_time_to_first_token_seconds",
            "Time from a request reaching the engine thread's inbox to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._tokens = Counter(
            "ft_generation_tokens", "Tokens streamed back to clients.", registry=self.registry
        )
        self._finished = Counter(
            "ft_requests_finished",
            "Requests finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )

    def attach(self, worker: Any) -> None:
        self.registry.register(_EngineCollector(worker))

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def count_token(self) -> None:
        self._tokens.inc()

    def count_finished(self, finish_reason: str) -> None:
        self._finished.labels(finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
