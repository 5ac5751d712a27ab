"""Engine mode's install / start / flag checks, against a fake `ft serve` in a test repo."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from ft.bisect.config import BisectConfig
from ft.bisect.driver import BisectOptions, EngineOptions, bisect
from ft.bisect.engine_judge import EngineJudge
from ft.bisect.envs import env_key, unsatisfied
from tests.bisect.helpers import culprit, make_project, step

FAKE_FT = r"""
import os, pathlib, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
flags = pathlib.Path("flags.txt").read_text().split()
if "--help" in args:
    print("Usage: ft serve [OPTIONS]")
    for flag in flags:
        print(f"  {flag} TEXT")
    sys.exit(0)
with open(os.environ["FAKE_STARTS"], "a") as f:
    f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "-") + "\n")
if pathlib.Path("crash-on-start").exists():
    print("RuntimeError: CUDA out of memory", flush=True)
    sys.exit(1)
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
figure = pathlib.Path("figure.txt").read_text().strip().encode()


class Figure(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(figure)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer((host, port), Figure)
print("INFO 11-29 10:00:00 Resolved config: moe_strategy='hybrid'", flush=True)
print("INFO 11-29 10:00:00 MoE experts: bf16 via", "torch" if float(figure) < 40 else "triton")
print(f"API server is ready to serve on {host}:{port}", flush=True)
server.serve_forever()
"""
PYPROJECT = '[project]\nname = "fake"\nversion = "0"\ndependencies = ["typer>=0.1"]\n'
FLAGS = "--model --host --port --moe-strategy\n"


def fake_workload():
    noise = random.Random(0)

    def run(base_url: str, opts, env) -> float:
        value = float(httpx.get(base_url + "/", timeout=10).text)
        return value * (1 + noise.gauss(0, 0.02))

    return run


@pytest.mark.timeout(180)
def test_engine_mode_skips_commits_that_cannot_serve_and_finds_the_step(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts.txt"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = {"pyproject.toml": PYPROJECT, "flags.txt": FLAGS, "ft/__init__.py": ""}
    base["ft/__main__.py"] = FAKE_FT
    changes = {
        0: base,
        5: {"flags.txt": "--model --host --port\n"},  # an older `ft serve`
        6: {"flags.txt": FLAGS, "crash-on-start": "x"},
        7: {"crash-on-start": None},
    }
    p = make_project(tmp_path, step(12, 8, 50.0, 30.0), changes)
    engine = EngineOptions(serve_args="--moe-strategy hybrid", start_timeout_s=30)
    opts = BisectOptions(
        range=f"{p.shas[0]}..{p.shas[-1]}", repo=str(p.repo), engine=engine,
        search=BisectConfig(repeats=3), out=str(tmp_path / "out"),
    )  # fmt: skip
    judge = EngineJudge(engine, cache=tmp_path / "envs", workload=fake_workload())
    rep = bisect(opts, log=print, judge=judge)
    assert culprit(rep) == p.shas[8]
    reasons = {r["index"]: r["reason"] for r in rep["commits"] if r["verdict"] == "skip"}
    assert "lacks --moe-strategy" in reasons[5]
    assert "exited (1) before it was ready: RuntimeError: CUDA out of memory" in reasons[6]
    assert rep["measure"]["serve_args"] == "--moe-strategy hybrid"
    rows = {r["index"]: r for r in rep["commits"]}
    assert rows[8]["facts"]["startup"][0] == "Resolved config: moe_strategy='hybrid'"
    report_md = (Path(rep["out"]) / "report.md").read_text()
    assert "- MoE experts: bf16 via triton\n+ MoE experts: bf16 via torch" in report_md
    starts = (tmp_path / "starts.txt").read_text().split()
    assert set(starts) == {"0"}  # every server ran with its worker's GPU
    # one server start per commit measured in the search, one per confirmation sample
    searched = [r for r in rep["commits"] if r["verdict"] in ("good", "bad")]
    confirm = sum(1 for r in rep["commits"] for s in r["samples"] if s["phase"] == "confirm")
    assert len(starts) == len(searched) + confirm + 1  # + the crash at 6


def test_environments_are_keyed_by_dependencies():
    assert unsatisfied(["typer>=0.1", "surely-not-installed-ft-xyz", "typer<0.0.1"]) == [
        "surely-not-installed-ft-xyz",
        "typer<0.0.1",
    ]
    assert env_key(["a", "b"]) == env_key(["a", "b"]) != env_key(["a", "b>=2"])


def test_a_commit_without_pyproject_is_skipped_with_the_reason(tmp_path):
    judge = EngineJudge(EngineOptions(), cache=tmp_path / "envs", workload=fake_workload())
    wt = tmp_path / "wt"
    wt.mkdir()
    skip = judge.measure(wt, {})
    assert "no pyproject.toml" in skip.reason


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path, monkeypatch):
    import os
    import socket

    from ft.bisect import engine_judge

    env = {**os.environ, "FAKE_STARTS": str(tmp_path / "starts.txt")}
    base = {"pyproject.toml": PYPROJECT, "flags.txt": FLAGS, "ft/__init__.py": ""}
    p = make_project(tmp_path, step(2, 1, 50.0, 30.0), {0: {**base, "ft/__main__.py": FAKE_FT}})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], engine_judge._free_port()])
        monkeypatch.setattr(engine_judge, "_free_port", lambda: next(ports))
        judge = EngineJudge(EngineOptions(start_timeout_s=30), tmp_path / "envs", fake_workload())
        try:
            value = judge.measure(p.repo, env)
        finally:
            judge.release(p.repo)
    assert isinstance(value, float), value
    assert len((tmp_path / "starts.txt").read_text().split()) == 2  # the taken port, then one more
