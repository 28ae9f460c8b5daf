"""Text limits checked on bytes and counts, before any templating or tokenizing.

A prompt of N bytes is at least ``N / L`` tokens, where ``L`` is the most bytes one token of
the vocabulary stands for; so a text over ``max_model_len x L`` bytes cannot fit the model and
is refused from its length alone (``--max-prompt-bytes`` sets another bound). Every message of
a chat renders to at least one token (its role's marker), so more messages than
``max_model_len`` cannot fit either (``--max-messages``). Both run on the parsed body before
its shape is walked (engine/server/api/front_door.py): a count costs nothing, the byte bound one
pass over at most that many messages, where walking, templating and tokenizing a 5 MB prompt
or 300,000 messages cost seconds and hundreds of MB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.server.api.protocol import MAX_PROMPTS, too_many_prompts


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes one token stands for: the longest vocabulary entry in
    UTF-8 (a byte-level BPE's symbols take 1-2 bytes each for one byte of text, a
    SentencePiece piece is its text), at least 1."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no derived bound
        return 0
    return max((len(str(token).encode("utf-8", "surrogatepass")) for token in vocab),
               default=1)


@dataclass(frozen=True)
class TextLimits:
    """The bounds one API server checks (0: none)."""

    max_prompt_bytes: int
    max_messages: int

    @classmethod
    def derive(cls, tokenizer: Any, max_model_len: int, max_prompt_bytes: int | None,
               max_messages: int | None) -> TextLimits:
        """The flags' values, or what cannot fit ``max_model_len`` tokens."""
        if max_prompt_bytes is None:
            longest = longest_token_bytes(tokenizer)
            max_prompt_bytes = max_model_len * longest if longest else 0
        return cls(max_prompt_bytes, max_model_len if max_messages is None else max_messages)

    def check_chat(self, messages: Any, tools: Any = None) -> None:
        """``messages``' count and text bytes (text parts and string contents, and the
        assistant tool calls' arguments; media URLs are media, bounded elsewhere), with
        ``tools``' text: all of it goes through the chat template and the tokenizer."""
        if not isinstance(messages, list):
            return  # the schema check names the field
        if self.max_messages and len(messages) > self.max_messages:
            raise InvalidRequestError(
                f"the request holds {len(messages)} messages, more than the "
                f"{self.max_messages} this server takes", param="messages",
                code="too_many_messages",
                hint="send fewer messages (the server's limit is --max-messages)")
        if not self.max_prompt_bytes:
            return
        total = _tools_bytes(tools)
        if total > self.max_prompt_bytes:
            raise self._too_long(total, "tools")
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += _nbytes(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        total += _nbytes(part["text"])
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for call in calls if isinstance(calls, list) else ():
                function = call.get("function") if isinstance(call, dict) else None
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if isinstance(arguments, str):
                    total += _nbytes(arguments)
            if total > self.max_prompt_bytes:
                raise self._too_long(total, "messages")

    def check_prompt(self, prompt: Any, max_model_len: int) -> None:
        """``/v1/completions``' prompt(s): each string's bytes, each id list's length."""
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int) else [prompt]
        if len(prompts) > MAX_PROMPTS:  # from the count, before a walk over every one
            raise too_many_prompts(len(prompts))
        for one in prompts:
            if isinstance(one, str) and self.max_prompt_bytes and \
                    _nbytes(one) > self.max_prompt_bytes:
                raise self._too_long(_nbytes(one), "prompt")
            if isinstance(one, list) and len(one) > max_model_len:
                raise InvalidRequestError(
                    f"a prompt of {len(one)} token ids is longer than the model's "
                    f"{max_model_len} tokens", param="prompt", code="prompt_too_long",
                    hint="send a shorter prompt (the server's limit is --max-model-len)")

    def _too_long(self, nbytes: int, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"the prompt text is over {nbytes} bytes, more than the {self.max_prompt_bytes} "
            "this server takes (more than its model's context could hold)", param=param,
            code="prompt_too_long",
            hint="send a shorter prompt (the server's limit is --max-prompt-bytes)")


def _tools_bytes(tools: Any) -> int:
    """The text bytes of ``tools`` (names, descriptions, parameter schemas): its strings,
    walked without recursion and without serializing it."""
    total, stack = 0, [tools]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += _nbytes(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
