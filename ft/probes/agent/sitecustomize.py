"""ft's in-process stack agent: samples every Python thread's stack, no ptrace needed.

`ft diagnose` puts this folder first on the target's PYTHONPATH and sets FT_AGENT_OUT; Python
imports `sitecustomize` at startup, so the target's code is unchanged. Without FT_AGENT_OUT or
FT_AGENT_ATTACH this does nothing. Standard library only: `ft` itself may not be importable in
the target. Each sample is one JSON line, flushed at once, so a target killed mid-run still
leaves every sample taken.

FT_AGENT_ATTACH=DIR (a service's unit file; `ft serve` starts the agent itself) samples on
demand: a thread looks once a second for DIR/request-PID.json, which `ft diagnose --pid` writes
and keeps touching; only while it stays fresh are stacks written, into DIR/SESSION/. Nobody
asking costs one stat() a second and writes nothing.
"""

import json  # imported here, not in the agent's thread: a fork mid-import would break the child
import os
import re
import sys
import threading
import time

THREAD_NAME = "ft-stack-agent"
REQUEST = "request-{pid}.json"  # in the FT_AGENT_ATTACH folder
LISTEN_EVERY = 1.0  # seconds between looks for a request
SESSION = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a folder name, never a path


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


def _leaf(frame) -> tuple:
    """What tells a thread's stack unchanged since the last sample: a caller's line cannot move
    while its callee runs, so the same leaf frame at the same line under the same caller means
    the same stack. Ids, not the frames: holding a frame would keep its locals (tensors) alive."""
    return id(frame), frame.f_code, frame.f_lineno, id(frame.f_back)


def _sample(own_ident: int, stack_ids: dict, defs: list, last: dict | None = None) -> list:
    """Each thread's stack as an id; a stack seen for the first time is defined in `defs`.
    `last` (ident -> (leaf, stack id)) lets a thread still in the same frame skip the walk."""
    last = {} if last is None else last
    by_ident = {t.ident: t for t in threading.enumerate()}
    out = []
    frames = sys._current_frames()
    for ident in [i for i in last if i not in frames]:  # threads that ended
        del last[ident]
    for ident, frame in frames.items():
        if ident == own_ident:  # never report the agent itself
            continue
        thread = by_ident.get(ident)
        try:
            leaf = _leaf(frame)
            seen = last.get(ident)
            if seen is not None and seen[0] == leaf:
                stack = seen[1]
            else:
                key = _stack_key(frame)
                if key not in stack_ids:
                    stack_ids[key] = len(stack_ids)
                    defs.append({"id": stack_ids[key], "frames": _frame_names(key)})
                stack = stack_ids[key]
                last[ident] = (leaf, stack)
        except AttributeError:
            # CPython 3.11 once handed a code object where a frame was (a thread mid-call, in the
            # CPU demo's hybrid startup): "'code' object has no attribute 'f_code'" had stopped
            # the agent for the rest of the run. That thread misses this sample; the rest do not.
            last.pop(ident, None)
            continue
        out.append(
            {
                "ident": ident,
                "tid": getattr(thread, "native_id", None),
                "name": thread.name if thread is not None else None,
                "stack": stack,
            }
        )
    return out


def _run(path: str, interval: float, keep_going=lambda: True) -> None:
    try:
        _loop(path, interval, keep_going)
    except Exception as exc:  # disk full, folder removed: stop sampling, never hurt the target
        sys.stderr.write(f"ft stack agent stopped: {exc}\n")


def _loop(path: str, interval: float, keep_going) -> None:
    own = threading.get_ident()
    pid = os.getpid()
    with open(path, "a", buffering=1) as out:
        hello = {"kind": "agent", "t": time.time(), "pid": pid, "tid": threading.get_native_id()}
        out.write(json.dumps(hello) + "\n")  # lets the probes tell the agent's thread apart
        stack_ids: dict = {}  # idle threads repeat one stack: each is written out once
        last: dict = {}  # each thread's leaf frame at the previous sample
        while keep_going():
            record = {"kind": "stacks", "source": "agent", "t": time.time(), "pid": pid}
            if len(stack_ids) > 50_000:  # bound the agent's memory on very long runs
                stack_ids.clear()
                last.clear()
                record["reset"] = True
            defs: list = []
            record["threads"] = _sample(own, stack_ids, defs, last)
            record["defs"] = defs
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
            out.flush()  # line-buffered already; explicit so a SIGKILL loses nothing written
            time.sleep(interval)


def _read_request(path: str):
    """The request `ft diagnose --pid` keeps fresh: (session, interval, timeout, inode), else
    None (absent, half written, stale or malformed)."""
    try:
        stat = os.stat(path)
        with open(path) as f:
            asked = json.load(f)
        session = str(asked["session"])
        interval = min(max(float(asked.get("interval", 0.1)), 0.01), 10.0)
        timeout = float(asked.get("timeout_s", 30.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not SESSION.fullmatch(session) or time.time() - stat.st_mtime > timeout:
        return None
    return session, interval, timeout, stat.st_ino


def _still_asked(path: str, inode: int, timeout: float) -> bool:
    """The same request, touched within its timeout: ft may have died without removing it."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return stat.st_ino == inode and time.time() - stat.st_mtime <= timeout


def _listen(folder: str) -> None:
    try:
        _serve_requests(folder)
    except Exception as exc:  # a bug here must not spam the service's log: say it once, stop
        sys.stderr.write(f"ft stack agent stopped listening: {exc}\n")


def _serve_requests(folder: str) -> None:
    """Sample only while `ft diagnose --pid` asks; between requests, one stat() a second."""
    request = os.path.join(folder, REQUEST.format(pid=os.getpid()))
    while True:
        asked = _read_request(request)
        if asked is not None:
            session, interval, timeout, inode = asked
            out = os.path.join(folder, session, f"stacks-{os.getpid()}.jsonl")
            if os.path.isdir(os.path.dirname(out)):  # ft made it; never create folders here
                _run(out, interval, lambda i=inode, t=timeout: _still_asked(request, i, t))
            while _still_asked(request, inode, timeout):  # one session per request
                time.sleep(LISTEN_EVERY)
        time.sleep(LISTEN_EVERY)


def _running() -> bool:
    """Whether this process already has an agent (sitecustomize and `ft serve` may both start
    one); after a fork only the forking thread survives, so a child starts its own."""
    return any(t.name == THREAD_NAME for t in threading.enumerate())


def start() -> None:
    """Start the agent thread if FT_AGENT_OUT (sample now) or FT_AGENT_ATTACH (on demand) is set."""
    folder = os.environ.get("FT_AGENT_OUT")
    attach = os.environ.get("FT_AGENT_ATTACH")
    if not (folder or attach) or _running():
        return
    if not getattr(start, "registered", False):  # a forked child samples itself too
        os.register_at_fork(after_in_child=start)
        start.registered = True
    if folder:
        interval = float(os.environ.get("FT_AGENT_INTERVAL") or 0.1)
        path = os.path.join(folder, f"stacks-{os.getpid()}.jsonl")
        target, args = _run, (path, interval)
    else:
        target, args = _listen, (attach,)
    threading.Thread(target=target, args=args, name=THREAD_NAME, daemon=True).start()


if __name__ == "sitecustomize":  # Python's startup hook; `ft serve` imports this to call start()
    for _step in (_chain_previous_sitecustomize, start):
        try:
            _step()
        except Exception as _exc:  # the agent must never break the target
            sys.stderr.write(f"ft stack agent: {_step.__name__}: {_exc}\n")
