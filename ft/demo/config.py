"""`ft demo`'s settings: one frozen config, the engine flags its servers get."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ft.errors import FtError

MODEL_PRESET = "demo"  # ft/engine/model/presets.py: 4 layers x 64 experts, H=256, I=256
MODEL_DTYPE = "bfloat16"  # the seed's expert format; the store stays bf16 on the CPU too
CACHE_RATE = 0.1  # expert cache slots / all experts: every decode step misses, hybrid splits
DEVICES = ("cpu", "cuda")
# On a GPU box hybrid fetches the seed box's share of its misses: 8.41 / (8.41 + 21.89) of the
# seed's profile (profiles/seed-epyc7302-rtxpro4000-gen3.json). A box with fast PCIe benches a
# split near 90% fetched, where the CPU half (and the planted regression) barely engages, as the
# seed report says of the H100. On the CPU device the engine's own fallback split applies.
SEED_BOX_FETCH = 0.278


@dataclass(frozen=True)
class DemoConfig:
    out: Path
    device: str
    prompts: int = 2  # bisect: requests per sample
    max_tokens: int = 16  # tokens per request (bisect and diagnose)
    repeats: int = 3  # bisect: samples per commit to start with (endpoints: twice)
    diagnose_prompts: int = 6  # requests per diagnose run (the probes need a few seconds)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise FtError(f"--device must be cpu or cuda, not {self.device!r}")
        small = {
            "--prompts": self.prompts, "--max-tokens": self.max_tokens,
            "--repeats": self.repeats, "--diagnose-prompts": self.diagnose_prompts,
        }  # fmt: skip
        if bad := [f"{k} {v}" for k, v in small.items() if v < 1]:
            raise FtError(f"{', '.join(bad)}: must be at least 1")
        if self.max_tokens < 4:
            raise FtError("--max-tokens must be at least 4 (decode speed needs a few tokens)")

    def engine_flags(self, model: Path) -> list[str]:
        """`ft serve` flags both strategies share (diagnose adds --moe-strategy itself)."""
        flags = ["--model", str(model), "--device", self.device, "--dtype", MODEL_DTYPE,
                 "--moe-cache-rate", str(CACHE_RATE)]  # fmt: skip
        if self.device == "cuda":
            flags += ["--moe-hybrid-max-fetch", str(SEED_BOX_FETCH)]
        return flags
