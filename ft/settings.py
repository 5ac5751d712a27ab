"""Every FT_* environment variable, read in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FT_CACHE_DIR: where profiles and built-in models live (default ~/.cache/freetoken)."""
    return Path(os.environ.get("FT_CACHE_DIR") or Path.home() / ".cache" / "freetoken")


def log_level() -> str:
    """FT_LOG_LEVEL: the engine's log level (default INFO)."""
    return os.environ.get("FT_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """FT_API_KEY: the key `ft serve` requires and `ft bench serve` sends (default: none)."""
    return os.environ.get("FT_API_KEY") or None
