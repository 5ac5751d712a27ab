"""The engine's startup log lines (docs/engine.md), read from a target's output.

A target that is an `ft serve` (through --cmd or the engine mode) says what it resolved; those
facts tell the findings whether CPU expert work is expected and which cores the pool owns.
"""

from __future__ import annotations

import re

_PATTERNS = {
    "strategy": re.compile(r"Resolved config: .*?moe_strategy='(\w+)'"),
    "device": re.compile(r"Resolved config: .*?device='(\w+)'"),
    "hybrid_fetch_pct": re.compile(r"--moe-hybrid-max-fetch \S+: fetching ([\d.]+)%"),
    "torch_threads": re.compile(r"torch intra-op threads: (\d+ -> \d+)"),
    "pool_threads": re.compile(r"CPU MoE executor ready: threads=(\d+)"),
    "pool_cores": re.compile(r"CPU MoE executor ready: .*?\(pinned to cores ([\d.,\- ]+)\)"),
    "ready": re.compile(r"API server is ready to serve on (\S+)"),
}
_KEEP = re.compile(
    r"Resolved config:|Free memory|MoE experts:|--moe-cache-auto|--moe-hybrid-max-fetch|"
    r"torch intra-op threads:|CPU MoE executor ready:|Allocating .* KV cache|ready to serve|"
    r"cpu-moe|inline"
)


def parse(log: str) -> dict:
    """Facts from the startup lines present (none for a program that is not `ft serve`)."""
    facts: dict = {}
    for key, pattern in _PATTERNS.items():
        match = pattern.search(log)
        if match:
            facts[key] = match.group(1)
    if "hybrid_fetch_pct" in facts:
        facts["hybrid_fetch_pct"] = float(facts["hybrid_fetch_pct"])
    if "pool_threads" in facts:
        facts["pool_threads"] = int(facts["pool_threads"])
    if "strategy" in facts:  # the resolved one: `auto` may have become hybrid
        facts["expects_cpu_pool"] = facts["strategy"] == "hybrid"
    return facts


def startup_lines(log: str, limit: int = 40) -> list[str]:
    """The lines worth quoting in a report, in order."""
    return [line for line in log.splitlines() if _KEEP.search(line)][:limit]
