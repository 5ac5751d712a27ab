"""The OpenAI wire format of `ft serve`: request models, the chat template, response bodies.

Types are strict as OpenAI's are ("16" is not an integer). Extra fields that OpenAI clients
send (user, logprobs, presence_penalty, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# The chat template: each message as "<|role|>\ncontent\n", then the assistant prefix.
# Plain and model-agnostic; the synthetic checkpoints have no template of their own.
CHAT_ROLE_FORMAT = "<|{role}|>\n{content}\n"
CHAT_ASSISTANT_PREFIX = "<|assistant|>\n"


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, gt=0)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per request
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: decode exactly max_tokens
    stop: StrictStr | list[StrictStr] | None = Field(None, max_length=4)

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    logprobs: StrictBool | StrictInt | None = None  # an int for completions, a bool for chat
    top_logprobs: StrictInt | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do (it would be ignored)."""
        wanted = {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}
        wanted |= {"echo": getattr(self, "echo", None)}
        wanted |= {"best_of": (getattr(self, "best_of", None) or 1) > 1}
        return next((name for name, value in wanted.items() if value), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    echo: StrictBool | None = None
    best_of: StrictInt | None = None


class _TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[_TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, gt=0)  # the newer name of max_tokens


def render_chat(messages: list[ChatMessage]) -> str:
    """The documented chat template: "<|role|>\\ncontent\\n" per message + "<|assistant|>\\n"."""
    body = "".join(CHAT_ROLE_FORMAT.format(role=m.role, content=m.text()) for m in messages)
    return body + CHAT_ASSISTANT_PREFIX


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the bodies of one response: completion or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        body["choices"] = choices
        body.update(extra or {})
        return body

    def whole(self, text: str, finish_reason: str | None, use: dict) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], {"usage": use})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], {"usage": use})

    def chunk(self, delta: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            body = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], {"usage": use})
