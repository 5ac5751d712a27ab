"""`jit`: numba's njit with the GIL released and a disk cache that follows the pool's source, not
where the source sits.

numba's own cache lives beside each source file (or under NUMBA_CACHE_DIR, in a folder named
after the file's directory), so every new checkout of the same code compiles the pool again:
10-17 s of LLVM on a 2-core box for every commit a bisect measures, every worktree a test makes.
Here the folder is named after the contents of this package's compiled modules (numba checks a
function's own file only; a change to a helper it calls must not load a stale kernel), under
NUMBA_CACHE_DIR when set, else under ft's cache dir. Identical code in any checkout compiles once.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

import numba
from numba.core import caching

from ft.settings import compile_cache_dir

PACKAGE = Path(__file__).resolve().parent


# a module whose functions compiled code may call: it imports numba, or this module
_COMPILED = re.compile(rb"^(from|import) (numba|ft\.engine\.cpu\.jit)\b", re.MULTILINE)


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """The digest of numba's version and of the package's compiled modules (not of the Python
    around them: a changed warning in pool.py compiles nothing)."""
    h = hashlib.sha256(numba.__version__.encode())
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_bytes()
        if _COMPILED.search(text):
            h.update(path.name.encode() + b"\0" + text)
    return h.hexdigest()[:16]


# public names since numba 0.61, with a leading underscore before
_LOCATOR = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl


class PoolSourceLocator(_LOCATOR):
    """The cache folder of this package's functions: <root>/cpu-<digest of its sources>."""

    def __init__(self, py_func, py_file) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(compile_cache_dir() / f"cpu-{sources_digest()}")

    def get_source_stamp(self):
        return sources_digest()  # not the file's mtime (older numbas): a checkout changes it

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != PACKAGE:
            return None  # someone else's function: numba's own locators
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError:
            return None  # not writable: numba's own locators (in the tree, or none)
        return self


def _register() -> None:
    classes = _IMPL._locator_classes
    if PoolSourceLocator not in classes:
        classes.insert(0, PoolSourceLocator)


_register()


def jit(**options):
    """numba.njit(nogil=True, cache=True, **options), cached by PoolSourceLocator."""
    return numba.njit(nogil=True, cache=True, **options)
