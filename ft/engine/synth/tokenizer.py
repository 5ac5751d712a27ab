"""A byte-level BPE tokenizer for synthetic checkpoints: a few merges learnt from a short text,
padded with made-up merges to the model's vocabulary size, plus an EOS token."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
_TEXT = (
    "The expert cache holds the most used experts of every layer on the accelerator. "
    "When a token routes to an expert that is not cached, the engine copies it from host "
    "memory over PCIe, or computes it on the CPU. Decode speed depends on the hit rate, "
    "the bandwidth of the link and the threads that do the work. "
)


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` with exactly vocab_size ids; EOS is the last one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size - 1, 400),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer)
    spec = json.loads(tok.to_str())
    _pad_merges(spec["model"], vocab_size - 1)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([EOS])
    return tok


def _pad_merges(model: dict, size: int) -> None:
    """Made-up merges of existing tokens until the vocabulary has `size` entries."""
    vocab, merges = model["vocab"], model["merges"]
    tokens = sorted(vocab, key=vocab.get)
    i = 0
    while len(vocab) < size:
        a, b = tokens[i % len(tokens)], tokens[(i * 31 + 7) % len(tokens)]
        i += 1
        if a + b in vocab or len(a + b) > 12:
            continue
        vocab[a + b] = len(vocab)
        merges.append([a, b])
        tokens.append(a + b)


def save_tokenizer(tok, out: Path, max_len: int) -> int:
    """tokenizer.json + tokenizer_config.json (AutoTokenizer loads them); -> the EOS id."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.token_to_id(EOS)
