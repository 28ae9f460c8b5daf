"""A small byte-level BPE tokenizer, trained locally and deterministically, that carries a
family's special tokens (no tokenizer can be downloaded here)."""

from __future__ import annotations

import json

_CORPUS = [
    "You are a helpful assistant. Describe this image in detail.",
    "What is happening in this video? Summarise the audio clip.",
    "The quick brown fox jumps over the lazy dog. A cat sits on a red mat by the window.",
    "user assistant system Picture Video Audio frame second colour motion left right top",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 yes no maybe, and; or: the a an of to in is it",
]


def train_byte_level_bpe(special_tokens: list[str], vocab_size: int = 512):
    """A ``tokenizers.Tokenizer`` (byte-level BPE) with ``special_tokens`` at ids 0..n-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    return tokenizer


def qwen2_tokenizer(special_tokens: list[str], eos: str, pad: str):
    """The real ``Qwen2Tokenizer`` class over a locally trained vocabulary."""
    from transformers import Qwen2Tokenizer

    trained = json.loads(train_byte_level_bpe(special_tokens).to_str())["model"]
    tok = Qwen2Tokenizer(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]],
                         unk_token=None, eos_token=eos, pad_token=pad)
    tok.add_tokens(special_tokens, special_tokens=True)
    return tok


def generic_tokenizer(special_tokens: list[str], bos: str, eos: str, pad: str, unk: str):
    """A fast tokenizer over a locally trained byte-level BPE (for Llama-based families)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=train_byte_level_bpe(special_tokens),
                                  bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk)
    tok.add_tokens(special_tokens, special_tokens=True)
    return tok
