"""Prompts of an exact length in tokens, as vLLM's ``random`` and ``prefix_repetition``
datasets count them: ``--random-input-len`` / ``--random-output-len`` /
``--random-range-ratio``, and ``--prefix-repetition-*``.

The tokenizer is ``--tokenizer``, else the target's model, as vLLM's bench takes it: the
``root`` its ``GET /v1/models`` entry names (the folder or Hub id the weights came from), else
its id, when that is a local folder with a tokenizer, one of this project's cached tiny models,
or a Hugging Face Hub id (``ORG/NAME``, downloaded into the Hub cache; ``HF_ENDPOINT`` and
``HF_TOKEN`` apply). A prompt is a run of the
tokenizer's own word tokens (a space and letters, one token alone, e.g. ``" cat"``): a
pre-tokenizer splits text before each space, so N such words are N tokens exactly, with no
merge across them (checked on every prompt made).

What the server counts beyond the text is taken off ``--random-input-len``, so that the
server's ``usage.prompt_tokens`` is the asked length: on a chat endpoint the chat template's
tokens (its system prompt, role markers, generation prompt: the tokenizer's template applied
to a one-message conversation, minus the message's own tokens), on ``/v1/completions`` the
special tokens the tokenizer adds (a BOS). vLLM's random dataset counts the text alone, so a
chat request of its ``--random-input-len 200`` reaches the server as 200 + the template's
tokens; here it reaches it as 200. ``prefix_repetition``'s ``--prefix-repetition-prefix-len``
and ``-suffix-len`` are the text's tokens, as vLLM's (the template comes before the shared
prefix on every request, so it is shared too); the result records the template's count.
Media (``--items-per-request``) add their own tokens: only text-only prompts are exact.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

#: A word token's text: one space and lowercase letters
_WORD = re.compile(r" [a-z]{2,}")
#: At least this many word tokens, or the prompts would be too repetitive to mean much
MIN_WORDS = 8
#: The word tokens looked at, at most (a large vocabulary has tens of thousands)
MAX_CANDIDATES = 8192


#: A Hugging Face Hub repository id (``ORG/NAME``), as the Hub allows them
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def _local(name: str) -> str | None:
    """``name`` as a tokenizer folder: a local folder holding a tokenizer, or this project's
    tiny model of that name (``tiny-ARCH`` / ``tiny:ARCH``) when it is cached."""
    path = Path(name).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json",
                                                                 "tokenizer_config.json")):
            return str(path)
        if path.exists():  # a folder (or file) here without a tokenizer: not a Hub id either
            return ""
    except OSError:  # a name too long for a path, a folder this user may not read
        return None
    tiny = re.fullmatch(r"tiny[:-]([a-z0-9_]+)", name)
    if tiny:
        from engine.models.loader import TINY_VERSION
        from engine.paths import cache_root

        folder = cache_root() / "models" / f"tiny-{tiny[1]}-v{TINY_VERSION}-seed0"
        if (folder / "config.json").is_file():
            return str(folder)
    return None


def hub_id(name: str) -> bool:
    """``name`` is shaped as a Hub repository id (no ``..``, no leading dot or dash)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def default_tokenizer(model_id: str, root: str | None = None) -> str | None:
    """The target's model as a tokenizer: its weights' ``root`` (from ``GET /v1/models``), else
    its id, as a local folder or cached tiny model (:func:`_local`), else as a Hub id; None
    when neither is one."""
    names = [n for n in (root, model_id) if n]
    for name in names:
        found = _local(name)
        if found:
            return found
    for name in names:
        if _local(name) is None and hub_id(name):
            return name
    return None


def resolve_tokenizer(flag: str | None, model_id: str, needed_by: str, loaded: Any = None,
                      root: str | None = None) -> tuple[Any, str, str]:
    """``(tokenizer, name, source)`` for prompts counted in tokens: ``--tokenizer`` (already
    ``loaded``, or loaded here), else the target's model when :func:`default_tokenizer` finds
    it (``root``: where the target says its weights came from); else an error naming the
    flags."""
    from aphrodite_cli.bench.load import vllm_compat
    from aphrodite_cli.bench.results.escape import printable

    if flag:
        return loaded or vllm_compat.load_tokenizer(flag), flag, "--tokenizer"
    found = default_tokenizer(model_id, root)
    if found is None:
        raise ConfigError(f"{needed_by} counts tokens, and the target's model "
                          f"{printable(model_id, 80)!r} is neither a local folder, a cached "
                          "tiny model nor a Hub id, so no tokenizer was found",
                          hint="pass --tokenizer FOLDER_OR_HUB_ID (the target model's)",
                          code="invalid_flag")
    try:
        return vllm_compat.load_tokenizer(found), found, "the target's model"
    except ConfigError:
        raise ConfigError(f"{needed_by} counts tokens, and the target's model "
                          f"{printable(found, 80)!r} could not be loaded as a tokenizer (a Hub "
                          "id needs the Hub or its cache: HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE)",
                          hint="pass --tokenizer FOLDER_OR_HUB_ID (the target model's)",
                          code="invalid_flag") from None


def token_range(length: int, ratio: float, flag: str) -> tuple[int, int]:
    """vLLM's range for ``--random-range-ratio``: [floor(n (1 - r)), ceil(n (1 + r))]."""
    low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    if low < 1:
        raise ConfigError(f"{flag} {length} with --random-range-ratio {ratio:g} can ask for "
                          f"{low} tokens", hint="a longer length or a smaller ratio",
                          code="invalid_flag")
    return low, high


@dataclass
class TokenPrompts:
    """Exact-length prompts from one tokenizer, for one endpoint (chat or completions)."""

    tokenizer: Any
    words: list[str]
    #: tokens the server counts beyond the text (the chat template's, or a BOS)
    overhead: int
    name: str = ""
    source: str = ""

    @classmethod
    def build(cls, tokenizer: Any, *, chat: bool, name: str = "", source: str = ""
              ) -> TokenPrompts:
        # candidates by the vocabulary's own spelling (byte-level BPE writes a leading space
        # as "Ġ", SentencePiece as "▁"), then kept when the text alone is that one token
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        candidates = [(i, " " + p[1:]) for i, p in enumerate(pieces)
                      if isinstance(p, str) and p[:1] in ("Ġ", "▁") and _WORD.fullmatch(
                          " " + p[1:])][:MAX_CANDIDATES]
        encoded = tokenizer([text for _, text in candidates],
                            add_special_tokens=False)["input_ids"] if candidates else []
        words = [text for (i, text), ids in zip(candidates, encoded, strict=True)
                 if list(ids) == [i]]
        if len(words) < MIN_WORDS:
            raise ConfigError(f"--tokenizer {name or '(the target model)'} has {len(words)} "
                              "word tokens (a space and letters); at least "
                              f"{MIN_WORDS} are needed to write prompts of a set length",
                              hint="pass the target model's tokenizer with --tokenizer",
                              code="invalid_flag")
        probe = "".join(words[:4])
        if chat:
            overhead = _template_tokens(tokenizer, probe) - len(_ids(tokenizer, probe))
        else:
            overhead = len(tokenizer(probe)["input_ids"]) - len(_ids(tokenizer, probe))
        return cls(tokenizer, words, max(overhead, 0), name, source)

    def text(self, tokens: int, rng: random.Random) -> str:
        """A text of exactly ``tokens`` tokens (the tokenizer's count, no special tokens)."""
        text = "".join(rng.choice(self.words) for _ in range(tokens))
        if len(_ids(self.tokenizer, text)) != tokens:  # a tokenizer that merges across words
            raise ConfigError(f"the tokenizer {self.name} does not split text at spaces, so "
                              "prompts of an exact length cannot be written with it",
                              hint="pass the target model's tokenizer with --tokenizer",
                              code="invalid_flag")
        return text

    def describe(self) -> dict[str, Any]:
        return {"tokenizer": self.name, "source": self.source,
                "server_counts_beyond_text": self.overhead}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_tokens(tokenizer: Any, content: str) -> int:
    """Tokens of a one-message conversation with the tokenizer's chat template (its
    generation prompt included); the text's own count when it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return len(_ids(tokenizer, content))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return len(ids)


def random_token_requests(prompts: TokenPrompts, num: int, *, input_len: int, output_len: int,
                          range_ratio: float, seed: int, nonce: int
                          ) -> list[tuple[str, int, int]]:
    """vLLM's ``random`` dataset in tokens: each request's input and output lengths drawn
    uniformly from the ranges of ``--random-range-ratio``; the server counts ``input_len``
    (the text is ``input_len`` - :attr:`TokenPrompts.overhead` tokens). (prompt, its input
    length as the server counts it, output length), deterministic for (seed, nonce)."""
    in_low, in_high = token_range(input_len, range_ratio, "--random-input-len")
    out_low, out_high = token_range(output_len, range_ratio, "--random-output-len")
    if in_low - prompts.overhead < 1:
        raise ConfigError(f"--random-input-len {input_len} (at least {in_low} with the range "
                          f"ratio) leaves no text: the server counts {prompts.overhead} "
                          "tokens of its own (the chat template) on every request",
                          hint=f"--random-input-len above {prompts.overhead}",
                          code="invalid_flag")
    rng = random.Random(f"{seed}:{nonce}")
    out = []
    for _ in range(num):
        length = rng.randint(in_low, in_high)
        out.append((prompts.text(length - prompts.overhead, rng), length,
                    rng.randint(out_low, out_high)))
    return out


def prefix_repetition_requests(prompts: TokenPrompts, num: int, *, prefix_len: int,
                               suffix_len: int, num_prefixes: int, seed: int, nonce: int
                               ) -> list[str]:
    """vLLM's ``prefix_repetition`` dataset: ``num_prefixes`` prefixes of ``prefix_len``
    tokens, each request one of them (in turn) and its own suffix of ``suffix_len`` tokens,
    the order shuffled."""
    rng = random.Random(f"{seed}:{nonce}")
    prefixes = [prompts.text(prefix_len, rng) for _ in range(num_prefixes)]
    texts = [prefixes[i % num_prefixes] + prompts.text(suffix_len, rng) for i in range(num)]
    rng.shuffle(texts)
    return texts
