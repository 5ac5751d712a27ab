"""The engine's logger. Startup lines are parsed by probes and bisect: keep their wording."""

from __future__ import annotations

import logging
import sys

from ft import settings

_FORMAT = "%(levelname)s %(asctime)s %(message)s"


def get_logger(name: str = "ft") -> logging.Logger:
    root = logging.getLogger("ft")
    if not root.handlers:  # configure once, on first use
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(settings.log_level())
        root.propagate = False
    return logging.getLogger(name)
