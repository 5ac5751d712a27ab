"""Why a process ft attached to (`--pid`) gave no Python stacks, and what would give them.

Text for the stacks-unavailable finding, from the attached target's context (ptrace facts, the
agent's state, its command line) and the sampler's py-spy events.
"""

from __future__ import annotations

from ft import settings
from ft.probes.stacks import AGENT_DIR


def stacks_advice(context: dict, events: list[dict]) -> tuple[str, str, bool]:
    """(why an attached process gave no Python stacks, what would give them, whether it matters:
    False for a program that is not Python)."""
    label = f"pid {context.get('pid')} (`{context.get('command')}`)"
    if not context.get("python", True):
        return f"{label} is not a Python process", "the thread and GPU probes still apply", False
    why = "; ".join(_pyspy_reasons(events) + [_agent_reason(context)])
    denied = any(e.get("event") == "ptrace-denied" for e in events)
    denied = denied or not (context.get("ptrace") or {}).get("expected", True)
    missing = any("not installed" in str(e.get("detail")) for e in events)
    ways = ways_to_stacks(context, denied, missing)
    return f"{label}: {why}", "To get stacks: " + "; ".join(ways) + ".", True


def _pyspy_reasons(events: list[dict]) -> list[str]:
    denied = [e for e in events if e.get("event") == "ptrace-denied"]
    failed = [e for e in events if e.get("event") == "py-spy-failed"]
    if denied:
        return [f"ptrace is not permitted, py-spy could not attach ({denied[0].get('detail')})"]
    if any("not installed" in str(e.get("detail")) for e in failed):
        return ["py-spy is not installed"]
    if failed:
        return [f"py-spy could not read it ({failed[0].get('detail')})"]
    return ["py-spy was not run (--stack-source agent)"]


def _agent_reason(context: dict) -> str:
    state = context.get("agent", "")
    if state.startswith("unreachable"):
        return f"its agent's folder is unusable ({state.partition(': ')[2]})"
    return {
        "not-enabled": f"it was not started with {settings.AGENT_ATTACH}, so it runs no agent",
        "no-answer": "its in-process agent did not answer",
        "not-requested": "the in-process agent was not asked (--stack-source py-spy)",
    }.get(state, f"agent: {state}")


def ways_to_stacks(context: dict, ptrace_denied: bool, pyspy_missing: bool) -> list[str]:
    """What would give Python stacks of an attached process, most direct first."""
    scope = (context.get("ptrace") or {}).get("scope")
    command = context.get("command") or "COMMAND"
    ways = []
    if pyspy_missing:
        ways.append("install py-spy (`pip install py-spy`)")
    if ptrace_denied and scope == 3:
        ways.append("ptrace_scope=3 forbids ptrace until reboot: use the agent (below)")
    elif ptrace_denied and scope == 2:
        ways.append("run `ft diagnose --pid` with CAP_SYS_PTRACE (as root: `sudo ft diagnose`)")
    elif ptrace_denied and scope == 1:
        ways.append(
            "`sudo sysctl kernel.yama.ptrace_scope=0`, or run `ft diagnose --pid` with "
            "CAP_SYS_PTRACE (as root), or start the program from its tracer, its parent: "
            f"`py-spy record -- {command}`"
        )
    elif ptrace_denied:
        ways.append(
            "run `ft diagnose --pid` as the target's user or as root (in a container, with "
            "CAP_SYS_PTRACE: `docker run --cap-add SYS_PTRACE`)"
        )
    ways.append(f'relaunch it under ft, which injects the agent: `ft diagnose --cmd "{command}"`')
    ways.append(_agent_way(context))
    return ways


def _agent_way(context: dict) -> str:
    state, folder = context.get("agent", ""), context.get("agent_folder")
    if state.startswith("unreachable"):
        return (
            f"its agent listens on {folder}, but {state.partition(': ')[2]}: make that folder "
            "writable for ft's user (e.g. `chmod 1777` it, or a group both share)"
        )
    if state == "no-answer":
        return (
            f"it has {settings.AGENT_ATTACH}={folder} but no agent answered: a program other "
            f"than `ft serve` also needs PYTHONPATH={AGENT_DIR} in its environment"
        )
    return (
        f"or put `Environment={settings.AGENT_ATTACH}=/run/ft-agent` in its unit file (a program "
        f"other than `ft serve` also `Environment=PYTHONPATH={AGENT_DIR}`; the folder's setup: "
        "docs/diagnose.md), restart it and attach again: stacks then come from the in-process "
        "agent, without ptrace"
    )
