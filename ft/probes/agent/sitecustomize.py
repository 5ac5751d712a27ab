"""ft's in-process stack agent: samples every Python thread's stack, no ptrace needed.

`ft diagnose` puts this folder first on the target's PYTHONPATH and sets FT_AGENT_OUT; Python
imports `sitecustomize` at startup, so the target's code is unchanged. Without FT_AGENT_OUT this
does nothing. Standard library only: `ft` itself may not be importable in the target. Each sample
is one JSON line, flushed at once, so a target killed mid-run still leaves every sample taken.
"""

import json  # imported here, not in the agent's thread: a fork mid-import would break the child
import os
import sys
import threading
import time


def _chain_previous_sitecustomize() -> None:
    """Run the sitecustomize we shadow (distributions ship one), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _stack_key(frame) -> tuple:
    """Root-first (code, line) pairs: cheap to build and hash on every sample."""
    key = []
    while frame is not None:
        key.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    key.reverse()
    return tuple(key)


def _frame_names(key: tuple) -> list:
    """'function (file:line)', the form py-spy and flamegraphs use; only for stacks new to us."""
    return [
        f"{getattr(c, 'co_qualname', c.co_name)} ({os.path.basename(c.co_filename)}:{line})"
        for c, line in key
    ]


def _sample(own_ident: int, stack_ids: dict, defs: list) -> list:
    """Each thread's stack as an id; a stack seen for the first time is defined in `defs`."""
    by_ident = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == own_ident:  # never report the agent itself
            continue
        thread = by_ident.get(ident)
        key = _stack_key(frame)
        if key not in stack_ids:
            stack_ids[key] = len(stack_ids)
            defs.append({"id": stack_ids[key], "frames": _frame_names(key)})
        out.append(
            {
                "ident": ident,
                "tid": getattr(thread, "native_id", None),
                "name": thread.name if thread is not None else None,
                "stack": stack_ids[key],
            }
        )
    return out


def _run(path: str, interval: float) -> None:
    try:
        _loop(path, interval)
    except Exception as exc:  # disk full, folder removed: stop sampling, never hurt the target
        sys.stderr.write(f"ft stack agent stopped: {exc}\n")


def _loop(path: str, interval: float) -> None:

    own = threading.get_ident()
    pid = os.getpid()
    with open(path, "a", buffering=1) as out:
        hello = {"kind": "agent", "t": time.time(), "pid": pid, "tid": threading.get_native_id()}
        out.write(json.dumps(hello) + "\n")  # lets the probes tell the agent's thread apart
        stack_ids: dict = {}  # idle threads repeat one stack: each is written out once
        while True:
            record = {"kind": "stacks", "source": "agent", "t": time.time(), "pid": pid}
            if len(stack_ids) > 50_000:  # bound the agent's memory on very long runs
                stack_ids.clear()
                record["reset"] = True
            defs: list = []
            record["threads"] = _sample(own, stack_ids, defs)
            record["defs"] = defs
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
            out.flush()  # line-buffered already; explicit so a SIGKILL loses nothing written
            time.sleep(interval)


def _start() -> None:
    folder = os.environ.get("FT_AGENT_OUT")
    if not folder:
        return
    if not getattr(_start, "registered", False):  # a forked child samples itself too
        os.register_at_fork(after_in_child=_start)
        _start.registered = True

    interval = float(os.environ.get("FT_AGENT_INTERVAL") or 0.1)
    path = os.path.join(folder, f"stacks-{os.getpid()}.jsonl")
    thread = threading.Thread(
        target=_run, args=(path, interval), name="ft-stack-agent", daemon=True
    )
    thread.start()


for _step in (_chain_previous_sitecustomize, _start):
    try:
        _step()
    except Exception as _exc:  # the agent must never break the target
        sys.stderr.write(f"ft stack agent: {_step.__name__}: {_exc}\n")
