"""Probes: threads from /proc, the GPU through NVML, Python stacks (agent or py-spy), the machine.

Each probe is usable alone; `ft.probes.sampler.Sampler` runs them together into one JSONL stream.
"""


def cpuinfo_cores() -> int:
    """Cores the target may run on (ft's own affinity mask; children inherit it)."""
    from ft.cpuinfo import allowed_cores

    return len(allowed_cores())
