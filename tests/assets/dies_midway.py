"""Fixture: spins in a named function beside an idle ft-cpu-moe pool, then SIGKILLs itself."""

import os
import signal
import sys
import threading
import time


def spin_until_killed(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: what a crash or OOM kill does


if __name__ == "__main__":
    stop = threading.Event()
    for k in range(2):
        threading.Thread(target=stop.wait, name=f"ft-cpu-moe-{k}", daemon=True).start()
    spin_until_killed(float(sys.argv[1]) if len(sys.argv) > 1 else 1.5)
