"""The text side of `ft serve`: token ids to streamed text deltas, and OpenAI stop strings."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is decode(all ids).

    Per token it decodes only a short window (the ids since the last clean boundary), as vLLM
    does, so a long output costs the event loop, and the GIL the engine thread needs, O(1) per
    token rather than O(length). A delta ending in an incomplete UTF-8 sequence is held back
    until a later token completes it; the last push checks against one full decode.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        self._prefix = 0  # window start: a clean boundary (the text before it is final)
        self._read = 0  # ids up to here are in `emitted`

    def push(self, token_id: int | None, final: bool = False) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        if final:
            return self._flush()
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or not after.startswith(before) or len(after) == len(before):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.emitted += delta
        return delta

    def _flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        if not text.startswith(self.emitted):
            return ""  # the windows disagreed with the whole (never seen); keep what was sent
        delta, self.emitted = text[len(self.emitted) :], text
        self._prefix = self._read = len(self.ids)
        return delta


class TextStream:
    """Detokenizer plus OpenAI `stop` strings: the text deltas that are safe to send.

    The text stops before the first stop string (which is not returned); while the text ends
    with the start of one, that tail is held back until the next token decides it.
    """

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.detok = Detokenizer(tokenizer)
        self.stops = stops
        self.sent = ""
        self.stopped = False

    def push(self, token_id: int | None, final: bool = False) -> str:
        self.detok.push(token_id, final=final)
        text = self.detok.emitted
        hits = [i for i in (text.find(s, len(self.sent)) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        elif not final:
            text = text[: len(text) - self._possible_stop_start(text)]
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def _possible_stop_start(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max(
            (k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
