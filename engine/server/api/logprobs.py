"""Log-probabilities in OpenAI's response shapes.

The engine reports, per generated token, ``(logprob, rank, top_ids, top_logprobs)``: plain
numbers from the model's raw distribution (log_softmax of the logits before temperature,
top-k and top-p: vLLM's default ``logprobs_mode="raw_logprobs"``). Token strings are decoded
here, in the API server, one ``tokenizer.decode([id])`` per id (as vLLM writes them; a token
that is part of a UTF-8 character decodes to U+FFFD), and ``bytes`` are that string's UTF-8.
Log-probabilities below -9999 (-inf included: JSON has no infinity) are written -9999.0, as
vLLM does.
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenStrings:
    """Token ids to the strings the logprobs show, decoded once per id; with ``as_ids`` (vLLM's
    ``return_tokens_as_token_ids``) written ``token_id:<id>``, which names every token
    exactly, also those that are not whole characters."""

    def __init__(self, tokenizer: Any, limit: int = 1 << 18) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._limit = limit

    def text(self, token_id: int, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._cache) < self._limit:
                self._cache[token_id] = text
        return text


def chat_entry(strings: TokenStrings, token_id: int, lp: tuple, as_ids: bool = False
               ) -> dict[str, Any]:
    """One ``choices[i].logprobs.content`` entry: the token, its logprob and bytes, and the
    ``top_logprobs`` most likely tokens (most likely first)."""
    logprob, _rank, top_ids, top_logprobs = lp

    def one(tid: int, value: float) -> dict[str, Any]:
        text = strings.text(tid, as_ids)
        return {"token": text, "logprob": _value(value), "bytes": list(text.encode())}

    return {**one(token_id, logprob),
            "top_logprobs": [one(t, v) for t, v in zip(top_ids, top_logprobs, strict=True)]}


class CompletionLogprobs:
    """One ``/v1/completions`` choice's ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token a dict from token string to logprob: the generated token and
    the ``logprobs`` most likely, so up to k + 1 entries, as vLLM and OpenAI's legacy API give)
    and ``text_offset`` (each token's start in the generated text, counted in the tokens'
    strings, continuing across streamed chunks)."""

    def __init__(self, strings: TokenStrings, as_ids: bool = False) -> None:
        self.strings = strings
        self.as_ids = as_ids
        self.offset = 0
        self.parts: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [],
                                            "top_logprobs": [], "text_offset": []}

    def add(self, token_id: int, lp: tuple) -> dict[str, Any]:
        """Append one token; returns that token alone in the same shape (a streamed chunk's)."""
        logprob, _rank, top_ids, top_logprobs = lp
        text = self.strings.text(token_id, self.as_ids)
        top = {text: _value(logprob)}
        for tid, value in zip(top_ids, top_logprobs, strict=True):
            top.setdefault(self.strings.text(tid, self.as_ids), _value(value))
        piece = {"tokens": [text], "token_logprobs": [_value(logprob)], "top_logprobs": [top],
                 "text_offset": [self.offset]}
        self.offset += len(text)
        for key, values in piece.items():
            self.parts[key].extend(values)
        return piece

    def body(self) -> dict[str, Any]:
        return self.parts


class ChatLogprobs:
    """One chat choice's ``logprobs``: ``content``, one :func:`chat_entry` per token."""

    def __init__(self, strings: TokenStrings, as_ids: bool = False) -> None:
        self.strings = strings
        self.as_ids = as_ids
        self.content: list[dict[str, Any]] = []

    def add(self, token_id: int, lp: tuple) -> dict[str, Any]:
        """Append one token; returns that token alone in the same shape (a streamed chunk's)."""
        entry = chat_entry(self.strings, token_id, lp, self.as_ids)
        self.content.append(entry)
        return {"content": [entry]}

    def body(self) -> dict[str, Any]:
        return {"content": self.content}
