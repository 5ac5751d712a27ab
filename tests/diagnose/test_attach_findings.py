"""stacks-unavailable, for an attached process: why it gave no stacks, what would give them."""

from ft.diagnose import findings as rules
from ft.diagnose.summary import summarize
from tests.diagnose.synthetic import T, engine_main, stream

NO_STACKS = [T(100, comm="ft-engine", cpu=99.0, state="R")]  # no Python name: no stack source
DENIED = {"kind": "event", "event": "ptrace-denied", "detail": "Permission Denied (os error 13)"}


def attached(scope=1, agent="not-enabled", python=True, cap=False, **extra) -> dict:
    ptrace = {"scope": scope, "cap_sys_ptrace": cap, "same_user": True, "expected": False}
    command = "ft serve --moe-strategy hybrid"
    facts = {"attached": True, "pid": 42, "command": command, "python": python, "agent": agent}
    return facts | {"agent_folder": None, "ptrace": ptrace} | extra


def test_ptrace_scope_1_names_the_setting_the_parent_the_relaunch_and_the_variable():
    summary = summarize(stream(NO_STACKS) + [DENIED], attached(scope=1))
    found = rules.findings(summary)
    (f,) = [f for f in found if f.id == "stacks-unavailable"]
    assert "ptrace-denied" not in [g.id for g in found]  # said once, in this finding
    assert f.severity == "warning" and "ptrace is not permitted" in f.title
    assert "not started with FT_AGENT_ATTACH" in f.title
    assert "kernel.yama.ptrace_scope=0" in f.next_step
    assert "`py-spy record -- ft serve --moe-strategy hybrid`" in f.next_step  # as its parent
    assert 'ft diagnose --cmd "ft serve --moe-strategy hybrid"' in f.next_step
    assert "Environment=FT_AGENT_ATTACH=" in f.next_step
    assert "PYTHONPATH=" in f.next_step  # for a program other than `ft serve`


def test_scope_2_needs_the_capability_and_3_only_the_agent():
    two = rules.stacks_unavailable(summarize(stream(NO_STACKS) + [DENIED], attached(2)))
    three = rules.stacks_unavailable(summarize(stream(NO_STACKS) + [DENIED], attached(3)))
    assert "CAP_SYS_PTRACE" in two[0].next_step and "sysctl" not in two[0].next_step
    assert "until reboot" in three[0].next_step and "sysctl" not in three[0].next_step


def test_an_agent_that_did_not_answer_or_cannot_be_reached_is_said_so():
    recs = stream(NO_STACKS) + [DENIED]
    (quiet,) = rules.stacks_unavailable(summarize(recs, attached(agent="no-answer")))
    assert "did not answer" in quiet.title and "PYTHONPATH=" in quiet.next_step
    unusable = attached(agent="unreachable: cannot use /run/ft-agent: Permission denied")
    (locked,) = rules.stacks_unavailable(summarize(recs, unusable))
    assert "Permission denied" in locked.title and "writable" in locked.next_step


def test_quiet_when_stacks_came_or_the_target_was_launched_by_ft():
    agent_stacks = stream([engine_main()])
    assert not rules.stacks_unavailable(summarize(agent_stacks + [DENIED], attached()))
    assert not rules.stacks_unavailable(summarize(stream(NO_STACKS) + [DENIED], {}))


def test_a_program_that_is_not_python_is_information_only():
    failed = {"kind": "event", "event": "py-spy-failed", "detail": "Error: not a python program"}
    (f,) = rules.stacks_unavailable(summarize(stream(NO_STACKS) + [failed],
                                              attached(python=False)))  # fmt: skip
    assert f.severity == "info" and "not a Python process" in f.title
