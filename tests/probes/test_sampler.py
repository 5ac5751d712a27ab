"""The sampler keeps py-spy's stops of the target to a tenth of the run."""

from __future__ import annotations

import os
import time

from ft.probes.sampler import PYSPY_MAX_PAUSED, Sampler, SamplerConfig, Stream


class SlowPySpy:
    """A dump that stops the target for `pause` seconds, as py-spy --native does."""

    def __init__(self, pause: float):
        self.pause, self.dumps = pause, 0

    def dump(self, pid: int) -> dict:
        time.sleep(self.pause)
        self.dumps += 1
        return {"kind": "stacks", "source": "py-spy", "t": time.time(), "pid": pid, "threads": []}


def test_py_spy_dumps_are_spaced_so_its_pauses_stay_a_tenth_of_the_run(tmp_path):
    config = SamplerConfig(interval=0.01, stack_source="py-spy", pyspy_every=0.01)
    sampler = Sampler(os.getpid(), Stream(tmp_path / "s.jsonl"), None, config)
    fake = sampler.pyspy = SlowPySpy(pause=0.05)
    start = time.monotonic()
    paused = 0.0
    while time.monotonic() - start < 1.5:
        before = fake.dumps
        began = time.monotonic()
        sampler.tick()
        if fake.dumps > before:
            paused += time.monotonic() - began
        time.sleep(config.interval)
    sampler.close()
    elapsed = time.monotonic() - start
    assert fake.dumps >= 2  # it still samples stacks
    assert paused / elapsed <= PYSPY_MAX_PAUSED * 1.5  # not one dump per 0.01 s interval
