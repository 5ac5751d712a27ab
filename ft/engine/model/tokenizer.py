"""The checkpoint's tokenizer: tokenizer.json via the `tokenizers` library (no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from ft.errors import FtError


def stop_token_ids(model_dir: str | Path, eos_token_id: int | None) -> set[int]:
    """EOS ids that end a sequence: the tokenizer's plus generation_config.json's (one or a
    list), as transformers' generate stops on."""
    stops = {eos_token_id} if eos_token_id is not None else set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except ValueError:
            raise FtError(f"{path} is not valid JSON") from None
        stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return stops


def load_tokenizer(model_dir: str | Path, eos_token_id: int | None) -> Tokenizer | IdsOnlyTokenizer:
    """The checkpoint's tokenizer; checkpoints without one still run from token ids."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return Tokenizer(model_dir, eos_token_id)
    return IdsOnlyTokenizer(eos_token_id)


class IdsOnlyTokenizer:
    """Stands in when a checkpoint has no tokenizer.json: ids in, no text out."""

    vocab_size = 0

    def __init__(self, eos_token_id: int | None):
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        raise FtError("this model directory has no tokenizer.json; pass token ids instead of text")

    def decode(self, ids: list[int]) -> str:
        return ""


class Tokenizer:
    """encode/decode/eos_token_id over tokenizer.json + tokenizer_config.json."""

    def __init__(self, model_dir: str | Path, eos_token_id: int | None = None):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(model_dir) / "tokenizer.json"
        try:
            self._tok = HfTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            raise FtError(f"cannot read {path}: {exc}") from None
        self.eos_token_id = _eos_id(Path(model_dir), self._tok, eos_token_id)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]  # model vocab may be larger
        return self._tok.decode(known, skip_special_tokens=True)


def _eos_id(model_dir: Path, tok, from_config: int | None) -> int | None:
    """The EOS id: config.json's eos_token_id (what transformers' generate uses), else the
    tokenizer_config.json's eos_token."""
    if from_config is not None:
        return from_config
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            eos = json.loads(cfg_path.read_text()).get("eos_token")
        except ValueError:
            raise FtError(f"{cfg_path} is not valid JSON") from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
    return None
