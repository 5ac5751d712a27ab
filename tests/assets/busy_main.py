"""Fixture: the main thread spins in a named function beside an idle pool named ft-cpu-moe-K."""

import threading
import time


def pool_worker(stop: threading.Event) -> None:
    stop.wait()


def spin_inline_experts(seconds: float) -> int:
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


if __name__ == "__main__":
    stop = threading.Event()
    pool = [
        threading.Thread(target=pool_worker, args=(stop,), name=f"ft-cpu-moe-{k}", daemon=True)
        for k in range(3)
    ]
    for t in pool:
        t.start()
    spin_inline_experts(60)
    stop.set()
