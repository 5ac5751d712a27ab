"""Fixture: a worker thread blocks on a lock the main thread holds while it sleeps."""

import threading
import time

lock = threading.Lock()


def wait_for_the_lock() -> None:
    with lock:
        pass


def hold_the_lock() -> None:
    with lock:
        worker = threading.Thread(target=wait_for_the_lock, name="lock-waiter", daemon=True)
        worker.start()
        time.sleep(60)


if __name__ == "__main__":
    hold_the_lock()
