"""The OpenAI wire format of `ft serve`: request models, the chat template, response bodies.

Types are strict as OpenAI's are ("16" is not an integer). Extra fields that OpenAI clients
send (user, logprobs, presence_penalty, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

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
