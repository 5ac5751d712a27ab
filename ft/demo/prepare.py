"""The demo's first stage (model and bandwidth profile) and the environment its children get."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ft import settings
from ft.demo.config import MODEL_DTYPE, MODEL_PRESET, DemoConfig
from ft.errors import FtError
from ft.report import write_json_atomic

Say = Callable[[str], None]


@dataclass(frozen=True)
class ProfileChoice:
    path: Path  # OUT/benchbw.json, the profile the demo's servers read
    wrote_default: bool  # True: there was none, the demo's measurement became the user's too
    default: Path  # the user's profile path


def demo_model(say: Say) -> Path:
    """The `demo` preset (bf16), made once in FT_CACHE_DIR/models/demo-HASH and reused."""
    from ft.engine.model.presets import PRESETS
    from ft.engine.synth.checkpoint import synth_checkpoint

    shape = json.dumps([PRESETS[MODEL_PRESET], MODEL_DTYPE], sort_keys=True)
    digest = hashlib.sha256(shape.encode()).hexdigest()[:8]  # a changed preset: a new model
    path = settings.cache_dir() / "models" / f"demo-{digest}"
    if (path / "config.json").is_file():
        say(f"reusing the demo model {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        stats = synth_checkpoint(MODEL_PRESET, path, dtype=MODEL_DTYPE, seed=0)
    except (OSError, FtError):
        if not (path / "config.json").is_file():  # not a concurrent demo that won the race
            raise
        return path
    say(f"made the demo model {path}: {stats.describe()}")
    return path


def measure_profile(config: DemoConfig, say: Say) -> ProfileChoice:
    """`ft bench bw --quick --formats bf16` into OUT/benchbw.json; also the user's default
    profile only where there is none."""
    from ft.bench.bw import BwConfig, run_bw
    from ft.profile import default_path

    default = default_path()
    wrote_default = not default.exists()
    device = "cuda" if config.device == "cuda" else None
    bw = BwConfig(formats=("bf16",), quick=True, device=device)  # the demo's model is float
    profile = run_bw(bw, lambda stage: say(f"bench bw: {stage}"))
    path = config.out / "benchbw.json"
    write_json_atomic(path, profile)
    if wrote_default:
        write_json_atomic(default, profile)
        say(f"wrote {path}, and {default} too: you had no default profile")
    else:
        say(f"wrote {path}; your profile {default} was left as it is")
    return ProfileChoice(path, wrote_default, default)


@contextmanager
def isolated_env(out: Path, profile: Path) -> Iterator[Path]:
    """What the diagnose and bisect children see: a cache dir under OUT holding the demo's
    profile (servers read it, bisect keeps its state there), INFO logs (probes parse the
    startup lines), and nothing of the user's git session, API key or fault switches."""
    from ft.demo.history import git_env

    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(profile, cache / "benchbw.json")
    dropped = [k for k in os.environ if k.startswith("GIT_")]
    dropped += ["FT_CPU_MOE_INLINE", "FT_API_KEY", "FT_AGENT_OUT"]
    wanted = {"FT_CACHE_DIR": str(cache), "FT_LOG_LEVEL": "INFO", **git_env(),
              # the pool's kernels, compiled once for every checkout (stage 1 did it already)
              "NUMBA_CACHE_DIR": str(settings.compile_cache_dir())}  # fmt: skip
    saved = {k: os.environ.get(k) for k in [*dropped, *wanted]}
    try:
        for k in dropped:
            os.environ.pop(k, None)
        os.environ.update(wanted)
        yield cache
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FtError(f"--out {out} is not an empty folder; give a new one")
