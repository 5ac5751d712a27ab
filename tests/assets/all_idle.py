"""Fixture: every thread sleeps (main and two workers)."""

import threading
import time


def idle_worker() -> None:
    time.sleep(60)


if __name__ == "__main__":
    for k in range(2):
        threading.Thread(target=idle_worker, name=f"idle-{k}", daemon=True).start()
    time.sleep(60)
