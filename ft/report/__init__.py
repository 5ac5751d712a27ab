"""Rendering shared by diagnose, bisect and bench: Markdown pieces and atomic file writes."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

GITHUB_COMMENT_LIMIT = 65_536  # characters GitHub accepts in one issue comment


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; cells are str()-ed and their pipes escaped."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join(" --- " for _ in headers) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def details(summary: str, body: str) -> str:
    """A collapsed `<details>` block, for the long parts of a report."""
    return f"<details>\n<summary>{summary}</summary>\n\n{body}\n\n</details>"


def code_block(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def plural(n: int, noun: str, many: str | None = None) -> str:
    """`1 commit`, `2 commits` (`many` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"
