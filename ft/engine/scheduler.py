"""Sequences and the scheduler: admit waiting requests into free KV slots (prefill), else
decode every running sequence; finish at EOS, max_tokens or max_model_len."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ft.engine.model.sampling import SamplingParams


@dataclass
class StepOutput:
    seq_id: int
    token_id: int | None  # None only for an aborted sequence's final output
    finished: bool
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"


@dataclass(eq=False)  # identity: two requests are never the same sequence
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: object = None
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    def __init__(self, num_slots: int, max_model_len: int, stop_token_ids: set[int]):
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.max_model_len, self.stop_token_ids = max_model_len, stop_token_ids

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences to run, is_prefill). New requests first, as in vLLM."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)
            return admitted, True
        return list(self.running), False

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[StepOutput]:
        outputs = []
        for seq, token in zip(seqs, token_ids, strict=True):
            seq.output_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason:
                self._release(seq)
            outputs.append(StepOutput(seq.seq_id, token, reason is not None, reason))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.stop_token_ids and not seq.params.ignore_eos:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def abort(self, seq_id: int) -> bool:
        for seq in list(self.waiting) + self.running:
            if seq.seq_id == seq_id:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                self._release(seq)
                return True
        return False

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
