"""The runner in-process: a probe that breaks mid-run still leaves a report of what it took."""

import sys

import pytest

from ft.diagnose.runner import DiagnoseConfig, diagnose
from ft.diagnose.targets import CommandTarget
from ft.probes.threads import ThreadProbe
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def test_a_probe_failing_mid_run_still_leaves_a_report(tmp_path, monkeypatch):
    real, calls = ThreadProbe.sample, []

    def breaks_on_the_fifth(self):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("probe bug")
        return real(self)

    monkeypatch.setattr(ThreadProbe, "sample", breaks_on_the_fifth)
    cmd = f"{sys.executable} {REPO_ROOT / 'tests/assets/busy_main.py'}"
    target = CommandTarget(cmd, tmp_path / "target.log")
    config = DiagnoseConfig(tmp_path, duration=20, interval=0.2, stack_source="agent")
    outcome, report = diagnose(target, config)
    assert outcome.stopped_by == "ft-error" and report["run"]["thread_samples"] == 4
    assert any(e["event"] == "ft-error" for e in report["events"])
    assert target.poll() is not None  # stopped, not left running
    assert (tmp_path / "report.md").exists()
