"""Probes: threads from /proc, the GPU through NVML, Python stacks (agent or py-spy), the machine.

Each probe is usable alone; `ft.probes.sampler.Sampler` runs them together into one JSONL stream.
"""
