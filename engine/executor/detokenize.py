"""A row's output text as its tokens arrive: incremental decoding and stop strings.

Decoding all of a row's tokens at every step costs time in the length of its output (the
tokenizer walks the whole list, twice over in transformers' argument conversion), so a long
generation's steps got slower as it went. :class:`Detokenizer` decodes a short window instead:
the tokens since the last emitted character plus the ones before them that their spelling may
depend on, and emits what the window's text gained (the method vLLM and TGI use; the windows'
texts are prefixes of the full decode, so the joined deltas equal decoding every token at once:
test_detokenize checks it on every family's tokenizer). Bytes of a character split across
tokens are held until the character is whole. Tokenizers whose decoder turns runs of byte
tokens into text (SentencePiece's byte fallback: Gemma, Llama) rewrite a whole run as
replacement characters when any byte in it is invalid, so there a run is held until a token
that is not a byte ends it.

:class:`StopStrings` holds back the last ``len(stop) - 1`` characters while a stop string may
still be forming, so a stream never sends text that a stop string later cuts off; the held text
goes out when the row ends for another reason.
"""

from __future__ import annotations

from typing import Any


def byte_tokens(tokenizer: Any) -> frozenset[int]:
    """When ``tokenizer``'s decoder has a byte fallback: the ids of its ``<0xNN>`` byte tokens
    (they decode as a run) and of its special tokens (skipped before decoding, so a run goes on
    across them); empty otherwise (byte-level BPE decodes bytes one by one)."""
    import json
    import re

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or '"ByteFallback"' not in json.dumps(
            json.loads(backend.to_str()).get("decoder")):
        return frozenset()
    byte = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    return frozenset(i for t, i in tokenizer.get_vocab().items() if byte.fullmatch(t)) | \
        frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False))


class Detokenizer:
    """The text of one row's tokens, a delta per token. ``byte_ids``: :func:`byte_tokens`
    of the tokenizer (computed once per tokenizer, not per row); ``ids``: the list the tokens
    go into (the row's own, so it is kept once)."""

    __slots__ = ("_bytes", "_decode", "_prefix", "_read", "_skip", "ids", "text")

    def __init__(self, tokenizer: Any, byte_ids: frozenset[int] = frozenset(),
                 ids: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._bytes = byte_ids
        self.ids: list[int] = ids if ids is not None else []
        self._prefix = 0  # the window starts here (context for the next tokens' spelling)
        self._read = 0  # tokens before this one are in ``text``
        self.text = ""

    def add(self, token: int, final: bool = False) -> str:
        """Append ``token``; the text it completes ("" while a character is split across
        tokens, unless ``final``: then the replacement character goes out, as a full decode
        writes it)."""
        self.ids.append(token)
        if token in self._bytes and not final:
            return ""  # a byte run's text is known when a token that is not a byte ends it
        window = self.ids[self._prefix:]
        before = self._decode(window[:self._read - self._prefix],
                              skip_special_tokens=self._skip) \
            if self._read > self._prefix else ""
        now = self._decode(window, skip_special_tokens=self._skip)
        if len(now) <= len(before) and not final:
            return ""  # a special token, or bytes of a character still to come
        if now.endswith("\ufffd") and not final:
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


class StopStrings:
    """Cuts a row's text at the first stop string; says how much of it may be sent yet."""

    __slots__ = ("_hold", "stops")

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def cut(self, text: str, grown_from: int, keep: bool = False) -> int | None:
        """Where the text ends at the first stop string in ``text`` (where it starts, or
        with ``keep`` where it ends: vLLM's ``include_stop_str_in_output``), looking only
        where one could end in the part that grew from ``grown_from`` on; None when none
        does."""
        found = self.find(text, grown_from, keep)
        return found[0] if found is not None else None

    def find(self, text: str, grown_from: int, keep: bool = False) -> tuple[int, str] | None:
        """:meth:`cut`'s end of the text and the stop string that ends it there (vLLM's
        ``stop_reason``): the first to start (with ``keep``, of two starting together the
        shorter; else the one ``stop`` lists first)."""
        if not self.stops:
            return None
        start = max(0, grown_from - self._hold)
        found = [(at, at + len(s) if keep else at, n, s) for n, s in enumerate(self.stops)
                 if (at := text.find(s, start)) != -1]
        if not found:
            return None
        _, end, _, stop = min(found)
        return end, stop

    def sendable(self, text: str) -> int:
        """How many characters of an unfinished row's ``text`` may be sent: all but those
        a stop string still forming could take back."""
        return len(text) - self._hold if self.stops else len(text)


class OutputText:
    """A row's output text as its stream sees it: decoded incrementally, cut at the first stop
    string, and how much of it has been sent. The tokens go into ``ids``. ``params`` (the
    row's sampling parameters) may ask for special tokens in the text
    (``skip_special_tokens`` false), the stop string kept (``include_stop_str_in_output``)
    and no stop string before ``min_tokens`` tokens."""

    __slots__ = ("_detokenizer", "_keep", "_min_tokens", "_stops", "sent", "stop_string",
                 "text")

    def __init__(self, tokenizer: Any, byte_ids: frozenset[int],
                 stops: list[str] | tuple[str, ...], ids: list[int], params: Any = None
                 ) -> None:
        self._detokenizer = Detokenizer(tokenizer, byte_ids, ids,
                                        getattr(params, "skip_special_tokens", True))
        self._stops = StopStrings(stops)
        self._keep = getattr(params, "include_stop_str_in_output", False)
        self._min_tokens = getattr(params, "min_tokens", 0)
        self.text = ""
        self.sent = 0
        #: the stop string that ended the row (vLLM's ``stop_reason``), once one did
        self.stop_string: str | None = None

    def add(self, token: int, last: bool, silent: bool = False) -> tuple[str, bool]:
        """Append ``token`` (``last``: the row's final one); the text to send now, and
        whether a stop string ended the row (:attr:`stop_string`). A ``silent`` last token
        (an EOS or a stop token) adds no text of its own unless the row's parameters keep
        the stop in the output (vLLM's detokenizer does the same); the text held back for a
        stop string goes out."""
        if silent and not self._keep:
            self._detokenizer.ids.append(token)
            return self.flush(), False
        grown_from = len(self._detokenizer.text)
        self._detokenizer.add(token, final=last)
        text, stopped = self._detokenizer.text, False
        found = self._stops.find(text, grown_from, self._keep) \
            if len(self._detokenizer.ids) >= self._min_tokens else None
        if found is not None:
            (at, self.stop_string), stopped = found, True
            text = text[:at]
        end = len(text) if stopped or last else self._stops.sendable(text)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent, self.text = max(self.sent, end), text
        return delta, stopped

    def flush(self) -> str:
        """The text held back (for a stop string that never came): the row ended."""
        held, self.sent = self.text[self.sent:], len(self.text)
        return held
