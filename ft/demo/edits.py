"""The demo's scripted history: ordinary commits around ONE that plants the seed's regression.

Every edit is an exact text replacement on the copied `ft` source, so a change to the source
that moves an anchor fails loudly here (and in tests/demo), never with a silently different
history. The planted commit is a plausible refactor: hybrid's CPU share is computed on the
calling thread (the engine thread) from fp32 copies of the whole layer's experts, instead of
being submitted to the pinned CPU MoE pool; the pool sits idle, the engine thread burns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ft.errors import FtError

Edit = Callable[[Path], None]  # applied to the scratch repository's working tree

AUTHORS = (
    ("Ana Ruiz", "ana.ruiz@example.com"),
    ("Kenji Sato", "kenji@example.com"),
    ("Priya Nair", "priya.nair@example.com"),
)


@dataclass(frozen=True)
class Commit:
    subject: str
    body: str
    author: int  # index into AUTHORS
    edits: tuple[Edit, ...]
    planted: bool = False


def replace(path: str, old: str, new: str) -> Edit:
    def apply(root: Path) -> None:
        file = root / path
        text = file.read_text() if file.is_file() else ""
        if text.count(old) != 1:
            raise FtError(f"the demo's scripted edit no longer applies: {path} lacks {old!r}")
        file.write_text(text.replace(old, new))

    return apply


def replace_line(path: str, prefix: str, value: str) -> Edit:
    """The first line starting with `prefix` becomes `prefix + value`."""

    def apply(root: Path) -> None:
        file = root / path
        lines = file.read_text().splitlines(keepends=True)
        at = next((i for i, ln in enumerate(lines) if ln.startswith(prefix)), None)
        if at is None:
            raise FtError(f"the demo's scripted edit no longer applies: {path} lacks {prefix!r}")
        lines[at] = prefix + value + "\n"
        file.write_text("".join(lines))

    return apply


def append(path: str, text: str) -> Edit:
    def apply(root: Path) -> None:
        file = root / path
        file.write_text(file.read_text().rstrip("\n") + "\n" + text)

    return apply


# -- the planted regression (ft/engine/strategies/hybrid.py) ----------------------------------

HYBRID = "ft/engine/strategies/hybrid.py"
PLANTED_FUNCTION = "_cpu_experts"  # the inline function the diagnosis must name

_SUBMIT_OLD = """\
        self.experts_cpu_total += len(experts)  # each is routed a token (_route, _split)
        bank = self.store.banks[layer]
        return self.pool.submit_routed(x_host, bank, self.fmt, ids, weights, experts)
"""
_SUBMIT_NEW = """\
        self.experts_cpu_total += len(experts)
        return _Computed(self._cpu_experts(layer, x_host.float(), ids, weights, experts))

    def _cpu_experts(self, layer, x, ids, weights, experts) -> torch.Tensor:
        \"\"\"The CPU share in one pass over the layer's fp32 weights: no pool round trip.\"\"\"
        w13, w2 = self.store.dequantize(layer, torch.float32)  # [E, 2I, D], [E, D, I]
        inter, out = w2.shape[2], torch.zeros_like(x)  # [T, D]
        for e in experts:
            tokens, slots = (ids == e).nonzero(as_tuple=True)  # [n], [n]
            h = x[tokens] @ w13[e].T  # [n, 2I]
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # [n, I]
            out.index_add_(0, tokens, (act @ w2[e].T) * weights[tokens, slots, None].float())
        return out
"""
_COMPUTED = '''

class _Computed:
    """A CPU share computed already, with the pool handle's interface."""

    def __init__(self, out: torch.Tensor):
        self._out, self.ran_on = out, {threading.current_thread().name}

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self._out
'''

PLANTED = Commit(
    subject="Refactor hybrid CPU path: one pass over the layer's weights instead of pool jobs",
    body=(
        "At decode batch a layer sends two to four experts to the CPU, and the pool's\n"
        "submit/wait round trip costs more than their matmuls on small experts. Compute\n"
        "them directly in fp32 from the layer's host weights, in split_misses' order."
    ),
    author=1,
    edits=(
        replace(HYBRID, _SUBMIT_OLD, _SUBMIT_NEW),
        replace(HYBRID, "import math\n", "import math\nimport threading\n"),
        append(HYBRID, _COMPUTED),
    ),
    planted=True,
)

# -- ordinary commits: real, harmless edits (docs, comments, a log wording) --------------------

BEFORE = (
    Commit(
        "README: say what to attach when reporting a slowdown",
        "",
        0,
        (
            append(
                "README.md",
                "\n## Reporting a slowdown\n\nAttach the `report.md` that `ft diagnose` and "
                "`ft bisect` write: each fits in one issue comment.\n",
            ),
        ),
    ),
    Commit(
        "offload: comment on how hits and misses share the slots",
        "",
        2,
        (
            replace(
                "ft/engine/strategies/offload.py",
                "        step = self.cache.num_slots",
                "        # Hits and misses go through the same slots: a miss is copied in, then"
                " computed.\n        step = self.cache.num_slots",
            ),
        ),
    ),
    Commit(
        "cpu_moe: clearer wording of the inline warning",
        "The warning is not a startup line; probes do not parse it.",
        1,
        (
            replace(
                "ft/engine/cpu/pool.py", "computed outside the pool, on", "ran outside the pool, on"
            ),
        ),
    ),
)

AFTER = (
    Commit(
        "hybrid: comment on who calls the strategy",
        "",
        0,
        (
            replace(
                HYBRID,
                "\nclass HybridStrategy(",
                "\n# One object per engine: the model calls forward() once per MoE layer.\n"
                "class HybridStrategy(",
            ),
        ),
    ),
    Commit(
        "bench: say why --quick's small experts are enough",
        "",
        2,
        (
            replace(
                "ft/bench/bw.py",
                "--quick a small one that fits a CI box.\n",
                "--quick a small one that fits a CI box\n"
                "    # (the rules read a ratio of two bandwidths, which the shape barely moves).\n",
            ),
        ),
    ),
    Commit(
        "pyproject: shorter description",
        "",
        1,
        (replace_line("pyproject.toml", "description = ", '"Diagnose and bisect MoE slowdowns"'),),
    ),
)
