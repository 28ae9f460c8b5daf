"""Tool-call parsers for ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser``): the calls a
model wrote in its own format, taken out of its text.

``hermes`` (the format of Qwen2.5's and Qwen3-VL's templates, NousResearch's Hermes): each
call a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``; the text before the first call is the answer's content. A block that is
not such an object stays text (as vLLM leaves it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.S)


def hermes(text: str, names: Collection[str] | None = None
           ) -> tuple[str | None, list[tuple[str, Any]]]:
    """``text``'s content (None when only calls) and its calls as (name, arguments). Text
    that is no call after all (a block that does not parse, nests past the parser's stack,
    or names a function not among ``names``, the declared tools: a model talked into calling
    something it was not given) stays text; text after the last call stays content."""
    at = text.find(START)
    if at < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[at:]):
        try:
            call = json.loads(block)
        except (ValueError, RecursionError):
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or (
                names is not None and call["name"] not in names):
            return text, []
        calls.append((call["name"], call.get("arguments", call.get("parameters", {}))))
    end = text.rfind(END)
    content = (text[:at] + (text[end + len(END):] if end >= 0 else "")).strip()
    return content or None, calls


class HermesStream:
    """A streamed answer's content as it may go out: text that cannot be the start of a
    call's tag is sent at once; from the first ``<tool_call>`` on, the rest is held for the
    calls, parsed at the end (:meth:`finish`)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names  # the declared tools (see hermes)
        self.text = ""
        self._sent = 0
        self.calling = False

    def add(self, delta: str) -> str:
        """The content of ``delta`` that may go out now."""
        self.text += delta
        if self.calling:
            return ""
        at = self.text.find(START, self._sent)
        if at >= 0:
            self.calling = True
            out, self._sent = self.text[self._sent:at], at
            return out
        keep = next((k for k in range(min(len(START) - 1, len(self.text)), 0, -1)
                     if START.startswith(self.text[-k:])), 0)  # a tag's start held back
        end = len(self.text) - keep
        out, self._sent = self.text[self._sent:end], max(end, self._sent)
        return out

    def finish(self) -> tuple[str, list[tuple[str, Any]]]:
        """The content still held (a tag's start that never became one, or text that was
        no call after all) and the calls."""
        _, calls = hermes(self.text, self.names)
        if not calls:
            return self.text[self._sent:], []
        return "", calls
