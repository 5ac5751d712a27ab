"""Fixture: a service started outside ft. Its engine thread spins in a named function while a pool
of named threads idles; the main thread writes a heartbeat count to the file named by argv[1].

Threads get kernel names as the engine's do (/proc/PID/task/TID/comm), so probes that read no
Python stack still tell them apart.
"""

import ctypes
import sys
import threading
import time

PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def pool_worker(k: int, stop: threading.Event) -> None:
    name_os_thread(f"ft-cpu-moe-{k}")
    stop.wait()


def spin_inline_experts(stop: threading.Event) -> None:
    name_os_thread("ft-engine")
    n = 0
    while not stop.is_set():
        n += 1


def heartbeat(path: str, seconds: float) -> None:
    end = time.monotonic() + seconds  # never outlive a test that lost track of it
    beat = 0
    while time.monotonic() < end:
        beat += 1
        with open(path, "w") as f:
            f.write(str(beat))
        time.sleep(0.1)


if __name__ == "__main__":
    stop = threading.Event()
    for k in range(3):
        threading.Thread(target=pool_worker, args=(k, stop), name=f"ft-cpu-moe-{k}").start()
    threading.Thread(target=spin_inline_experts, args=(stop,), name="ft-engine").start()
    heartbeat(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)
    stop.set()
