"""Expert formats: the registry. `FORMATS[name]` is the format object (ft.engine.formats.base
says what one declares); `format_of(quantization_config)` names a checkpoint's format.

Only routed experts are quantised: a checkpoint's dense projections (attention, the router,
dense MLP layers, the LM head) stay in its float dtype.
"""

from __future__ import annotations

from ft.engine.formats.base import ExpertFormat, Part, Parts
from ft.engine.formats.floating import FloatFormat
from ft.engine.formats.fp8_block import Fp8BlockFormat
from ft.engine.formats.int8 import Int8Format
from ft.engine.formats.nvfp4 import Nvfp4Format
from ft.errors import FtError

__all__ = ["FORMATS", "ExpertFormat", "Part", "Parts", "format_of", "get_format"]

FORMATS: dict[str, ExpertFormat] = {
    f.name: f for f in (FloatFormat(), Int8Format(), Fp8BlockFormat(), Nvfp4Format())
}


def get_format(name: str) -> ExpertFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise FtError(
            f"unknown expert format {name!r} (choose from {', '.join(FORMATS)})"
        ) from None


def format_of(quantization_config: dict | None) -> str:
    """The expert format a config.json `quantization_config` describes (none: `bf16`)."""
    for fmt in FORMATS.values():
        if fmt.matches(quantization_config):
            return fmt.name
    method = (quantization_config or {}).get("quant_method")
    raise FtError(
        f"unsupported quantization_config (quant_method {method!r}): the engine reads "
        "fp8 with weight_block_size [128, 128], modelopt NVFP4 and compressed-tensors int8 "
        "channel-wise, for routed experts only"
    )
