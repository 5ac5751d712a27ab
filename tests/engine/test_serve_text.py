"""The server's text pipeline: incremental detokenization and stop strings (no server)."""

from __future__ import annotations

import random

import pytest

from ft.engine.serve.text import Detokenizer, TextStream


class _ByteTokenizer:
    """One byte per token: multi-byte characters arrive in pieces, as with real BPE tokenizers."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_deltas_join_to_the_whole_text():
    ids = list("naïve ☃ ok".encode())
    detok = Detokenizer(_ByteTokenizer())
    deltas = [detok.push(i, final=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    assert "".join(deltas) == "naïve ☃ ok"
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["☃"], "naïve "),
        (["ve ", "zz"], "naï"),
        (["o", "ok"], "naïve ☃ "),
        (["nope"], "naïve ☃ ok"),
    ],
)
def test_text_stream_stops_before_the_stop_string(stops, expected):
    ids = list("naïve ☃ ok".encode())
    stream = TextStream(_ByteTokenizer(), stops)
    deltas = []
    for k, token in enumerate(ids):
        deltas.append(stream.push(token, final=(k == len(ids) - 1)))
        if stream.stopped:
            break
    assert "".join(deltas) == expected
    assert stream.stopped == (expected != "naïve ☃ ok")


def test_windowed_deltas_join_to_the_full_decode_of_a_real_tokenizer():
    from ft.engine.model.tokenizer import Tokenizer
    from ft.engine.synth.checkpoint import builtin_tiny

    tokenizer = Tokenizer(builtin_tiny())
    rng = random.Random(0)
    for _ in range(300):  # random ids: stray UTF-8 pieces, partial characters, spaces
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        detok = Detokenizer(tokenizer)
        deltas = [detok.push(t, final=(k == len(ids) - 1)) for k, t in enumerate(ids)]
        assert "".join(deltas) == tokenizer.decode(ids)
