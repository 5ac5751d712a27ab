"""How a diagnose run sampled, and what the probes were measured to cost in that configuration.

The figures mirror docs/performance.md ("What the probes cost"), each measured by
`ft bench probes`: end-to-end decode tok/s without probes and under them, alternated on one warm
server; a row is the mean overhead over rounds with its 95% interval. A report quotes the row of
its own configuration, so a reader knows how far a tok/s taken under probes may sit below the
same run without them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ft.probes.sampler import sampler_config


@dataclass(frozen=True)
class MeasuredCost:
    box: str  # "gpu": a GPU box; "cpu": the 2-core CI box (docs/performance.md, Machines)
    stack_source: str
    interval: float  # threads and GPU, seconds
    agent_interval: float
    overhead_pct: float  # mean loss of end-to-end decode tok/s, percent
    low_pct: float  # its 95% interval
    high_pct: float
    date: str
    command: str


def _rows(box: str, date: str, command: str, table: tuple) -> tuple[MeasuredCost, ...]:
    """One run of `ft bench probes`: (source, interval, agent interval, pct, low, high) rows."""
    return tuple(MeasuredCost(box, *row[:6], date, command) for row in table)


# The CI box's kind (2 vCPU Xeon), quiet, 8 rounds: intervals some +-2-4% wide. The GPU box
# (H100, 8 layers of qwen3-30b-a3b, offload): the default over 8 rounds (+-4%); the other
# settings over 3 rounds only (runs without probes spread 14%: intervals +-15-30%).
# See docs/diagnose.md.
_CPU_RUN = (  # /tmp/probes-tiny: ft model synth --preset tiny
    "ft bench probes --model /tmp/probes-tiny --prompts 6 --max-tokens 256 --repeats 8 "
    "--sources agent,py-spy,auto --fast 5"
)
_GPU_RUN = (  # /tmp/q8: ft model synth --preset qwen3-30b-a3b --layers 8
    "ft bench probes --model /tmp/q8 --serve-args '--moe-strategy offload --moe-cache-rate 0.15' "
    "--prompts 6 --max-tokens 192"
)
_CPU = (
    ("agent", 0.5, 0.1, 0.8, -1.8, 3.5),
    ("agent", 0.1, 0.02, 2.6, 0.5, 4.7),
    ("py-spy", 0.5, 0.1, 0.9, -1.0, 2.9),
    ("py-spy", 0.1, 0.02, 5.0, 2.3, 7.8),
    ("auto", 0.5, 0.1, 2.4, 0.9, 3.9),
    ("auto", 0.1, 0.02, 4.2, 0.5, 7.8),
)
_GPU_DEFAULT = (("auto", 0.5, 0.1, 1.3, -2.7, 5.4),)
_GPU_OTHERS = (
    ("auto", 0.1, 0.02, -0.8, -25.5, 23.9),
    ("agent", 0.5, 0.1, -0.8, -16.5, 14.8),
    ("agent", 0.1, 0.02, 7.7, 0.3, 15.1),
)
MEASURED: tuple[MeasuredCost, ...] = (
    _rows("cpu", "2026-12-05", _CPU_RUN, _CPU)
    + _rows("gpu", "2026-12-05", _GPU_RUN + " --repeats 8 --sources auto --fast 0", _GPU_DEFAULT)
    + _rows("gpu", "2026-12-05", _GPU_RUN + " --repeats 3 --sources auto,agent", _GPU_OTHERS)
)


def expected_cost(
    box: str, stack_source: str, interval: float, agent_interval: float
) -> MeasuredCost | None:
    """The measured row of exactly this configuration, if there is one."""
    for row in MEASURED:
        same = (row.box, row.stack_source, row.interval) == (box, stack_source, interval)
        agent_free = stack_source == "py-spy"  # the agent's interval does not matter then
        if same and (agent_free or row.agent_interval == agent_interval):
            return row
    return None


def sampling(config: dict, attached: bool, counts: dict[str, int], gpu: bool) -> dict:
    """report.json's `sampling`: each probe's source, cadence and samples, and the cost."""
    interval = float(config.get("interval", 0.5))
    source = config.get("stack_source", "auto")
    agent_interval = float(config.get("agent_interval", 0.1))
    block: dict = {
        "threads": {"source": "/proc", "interval_s": interval, "samples": counts.get("threads", 0)},
        "gpu": {"source": "NVML", "interval_s": interval, "samples": counts.get("gpu", 0)},
        "stacks": {},
    }
    if source != "py-spy":
        block["stacks"]["agent"] = {
            "interval_s": agent_interval,
            "samples": counts.get("stacks:agent", 0),
        }
    if source != "agent":
        spy = sampler_config(interval, source, may_pause=not attached)
        block["stacks"]["py-spy"] = {
            "mode": "--native, pauses the target" if spy.pyspy_pause else "--nonblocking",
            "every_s": spy.pyspy_every,
            "max_paused": spy.pyspy_max_paused if spy.pyspy_pause else 0.0,
            "samples": counts.get("stacks:py-spy", 0),
        }
    box = "gpu" if gpu else "cpu"
    row = None if attached else expected_cost(box, source, interval, agent_interval)
    block["expected_cost"] = asdict(row) if row else None
    block["expected_cost_note"] = _note(row, box, attached)
    return block


def _note(row: MeasuredCost | None, box: str, attached: bool) -> str:
    if row is not None:
        return (
            f"measured {row.overhead_pct:+.1f}% of end-to-end decode tok/s (95% interval "
            f"{row.low_pct:+.1f}% to {row.high_pct:+.1f}%) on the {box} box, {row.date}"
        )
    if attached:
        return "not measured for an attached process (py-spy --nonblocking never pauses it)"
    return f"not measured for this configuration on a {box} box: measure it with `ft bench probes`"
