"""Reading a server's Prometheus `/metrics`: samples by name, and counter deltas over a run."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value, labelled samples of one name summed (e.g. over finish reasons)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's /metrics samples; empty where it has none (not every server exposes them)."""
    try:
        resp = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    try:
        return parse_metrics(resp.text)
    except ValueError:
        return {}


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every `ft_*_total` counter (plus the TTFT histogram's sum and count)."""
    names = [
        n
        for n in after
        if n.startswith("ft_") and n.endswith(("_total", "_seconds_sum", "_seconds_count"))
    ]
    return {n: after[n] - before.get(n, 0.0) for n in sorted(names)}
