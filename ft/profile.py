"""The bandwidth profile (schema 4, docs/profile.md): its checks, and the one set of rules.

    ratio            = cpu_moe_gbs / pcie_gather_gbs
    recommended      = "hybrid" if ratio >= threshold else "offload"
                       ("offload" with a note where the format has no CPU path or no PCIe numbers)
    fetch fraction f = pcie_gather_overlap_gbs / (pcie_gather_overlap_gbs + cpu_moe_overlap_gbs)

`decide()` is the only implementation: `auto`, the hybrid split's log line, `ft bench bw` and
`ft profile show` all call it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft import settings
from ft.errors import FtError

VERSION = 4
DEFAULT_THRESHOLD = 2.0
STRATEGIES = ("hybrid", "offload")

_NUM, _OPT_NUM, _INT, _STR, _OPT_STR = "number", "number|null", "int", "string", "string|null"
_SPEC: dict[str, dict[str, str]] = {
    "": {
        "written": _STR,
        "version": _INT,
        "cpu": "object",
        "gpu": "object|null",
        "threshold": _NUM,
        "ceilings": "object",
        "dtypes": "object",
        "dtype_kernels": "object",
    },
    "cpu": {"physical_cores": _INT, "threads_used": _INT, "model": _STR, "isa": _STR},
    "gpu": {"name": _STR, "pcie_gen": "int|null", "pcie_width": "int|null"},
    "ceilings": {
        "cpu_stream_read_gbs": _OPT_NUM,
        "pcie_linear_h2d_gbs": _OPT_NUM,
        "pcie_linear_d2h_gbs": _OPT_NUM,
    },
    "kernel": {
        "expert_bytes": _INT,
        "synth_experts": _INT,
        "cpu_moe_gbs": _OPT_NUM,
        "cpu_moe_isa": _OPT_STR,
        "isa_sweep": "object|null",
        "pcie_gather_gbs": _OPT_NUM,
        "cpu_moe_overlap_gbs": _OPT_NUM,
        "pcie_gather_overlap_gbs": _OPT_NUM,
        "ratio": _OPT_NUM,
        "recommended": "strategy",
        "note": _OPT_STR,
    },
}


@dataclass(frozen=True)
class Profile:
    data: dict[str, Any]  # the checked JSON, as written
    path: Path | None = None

    @property
    def threshold(self) -> float:
        return float(self.data["threshold"])

    @property
    def formats(self) -> list[str]:
        return list(self.data["dtype_kernels"])


@dataclass(frozen=True)
class Decision:
    fmt: str
    ratio: float | None  # cpu_moe_gbs / pcie_gather_gbs
    recommended: str  # "hybrid" | "offload"
    fetch_fraction: float | None  # of each decode step's misses, fetched over PCIe
    note: str | None
    threshold: float


def default_path() -> Path:
    return settings.cache_dir() / "benchbw.json"


def decide(profile: Profile | dict, fmt: str) -> Decision:
    """The profile's rules for one expert format (module docstring)."""
    data = profile.data if isinstance(profile, Profile) else profile
    threshold = float(data["threshold"])
    kernel = data["dtype_kernels"].get(fmt)
    if kernel is None:
        note = f"the profile has no {fmt!r} entry (run `ft bench bw --formats {fmt}`)"
        return Decision(fmt, None, "offload", None, note, threshold)
    fetch = fetch_fraction(kernel.get("pcie_gather_overlap_gbs"), kernel.get("cpu_moe_overlap_gbs"))
    cpu, pcie = kernel.get("cpu_moe_gbs"), kernel.get("pcie_gather_gbs")
    if not cpu:
        note = kernel.get("note") or f"CPU MoE has no {fmt} weight path; hybrid unavailable"
        return Decision(fmt, None, "offload", fetch, note, threshold)
    if not pcie:
        note = kernel.get("note") or "no PCIe measurement (no GPU); hybrid needs one"
        return Decision(fmt, None, "offload", fetch, note, threshold)
    ratio = cpu / pcie
    recommended = "hybrid" if ratio >= threshold else "offload"
    return Decision(fmt, ratio, recommended, fetch, kernel.get("note"), threshold)


def fetch_fraction(pcie_overlap: float | None, cpu_overlap: float | None) -> float | None:
    if pcie_overlap is None or cpu_overlap is None or pcie_overlap + cpu_overlap <= 0:
        return None
    return pcie_overlap / (pcie_overlap + cpu_overlap)


def fetch_log_line(d: Decision) -> str:
    """The startup line of `--moe-hybrid-max-fetch auto` (docs/engine.md; keep the words)."""
    if d.fetch_fraction is None:
        raise FtError(f"the bandwidth profile has no overlapped numbers for {d.fmt}: {d.note}")
    return (
        f"--moe-hybrid-max-fetch auto: fetching {d.fetch_fraction:.1%} of each decode step's"
        " expert misses over PCIe (benched PCIe/CPU bandwidth ratio), the rest on the CPU"
    )


def apply_rules(data: dict) -> dict:
    """Fill each format's ratio / recommended and the `dtypes` summary from decide()."""
    for fmt, kernel in data["dtype_kernels"].items():
        d = decide(data, fmt)
        kernel["ratio"] = None if d.ratio is None else round(d.ratio, 3)
        kernel["recommended"] = d.recommended
        kernel["note"] = d.note
    data["dtypes"] = {fmt: k["recommended"] for fmt, k in data["dtype_kernels"].items()}
    return data


def load_profile(path: str | os.PathLike | None = None) -> Profile:
    """Read and check a profile; every problem is one FtError line naming the field."""
    path = Path(path) if path else default_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FtError(f"no bandwidth profile at {path} (run `ft bench bw` to write one)") from None
    except OSError as exc:
        raise FtError(f"cannot read bandwidth profile {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FtError(
            f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    try:
        check(data)
    except FtError as exc:
        raise FtError(f"{path}: {exc}") from None
    return Profile(data, path)


def check(data: Any) -> None:
    """Raise FtError naming the first missing, wrong-typed or wrong-version field."""
    if not isinstance(data, dict):
        raise FtError(f"the profile should be a JSON object, got {_type_name(data)}")
    if "version" in data and data["version"] != VERSION:
        raise FtError(
            f"field 'version' is {data['version']!r}, expected {VERSION} (re-run `ft bench bw`)"
        )
    data.setdefault("gpu", None)  # descriptive, read by no rule: profiles of other builds lack it
    _check_fields(data, _SPEC[""], "")
    for section in ("cpu", "gpu", "ceilings"):
        if data[section] is not None:
            _check_fields(data[section], _SPEC[section], f"{section}.")
    for fmt, kernel in data["dtype_kernels"].items():
        if not isinstance(kernel, dict):
            raise FtError(
                f"field 'dtype_kernels.{fmt}' should be an object, got {_type_name(kernel)}"
            )
        _check_fields(kernel, _SPEC["kernel"], f"dtype_kernels.{fmt}.")
    for fmt, strategy in data["dtypes"].items():
        _check_value(strategy, "strategy", f"dtypes.{fmt}")


def _check_fields(obj: dict, spec: dict[str, str], prefix: str) -> None:
    for name, kind in spec.items():
        if name not in obj:
            raise FtError(f"missing field '{prefix}{name}'")
        _check_value(obj[name], kind, prefix + name)


def _check_value(value: Any, kind: str, field: str) -> None:
    ok = any(_is(value, k) for k in kind.split("|"))
    if not ok:
        want = "'hybrid' or 'offload'" if kind == "strategy" else kind.replace("|", " or ")
        raise FtError(f"field '{field}' should be {want}, got {_type_name(value)} {value!r:.40}")


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool):  # JSON true/false is no number
        return False
    return {
        "null": value is None,
        "int": isinstance(value, int),
        "number": isinstance(value, int | float),
        "string": isinstance(value, str),
        "object": isinstance(value, dict),
        "strategy": value in STRATEGIES,
    }[kind]


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", type(None): "null", bool: "boolean"}.get(
        type(value), "number"
    )
