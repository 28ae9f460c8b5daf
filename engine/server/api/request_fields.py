"""Every request field OpenAI's and vLLM's chat/completions APIs define, and what this server
does with it: honoured, accepted as a label (it asks nothing of the answer), or refused with a
400 naming it unless it holds its "unused" value (:data:`REFUSED`, checked by
engine/server/api/protocol.py). Any other field is ignored, as vLLM ignores it, and logged once per
name, so a misspelt or new field is seen in the log and never silently taken as honoured.

tests/unit/test_request_fields.py walks the field lists of vLLM's ``ChatCompletionRequest`` and
``CompletionRequest`` and of the ``openai`` client's ``create()`` (copied into
tests/request_fields.json) against this table and against a live server.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("aphrodite.server")

#: fields both endpoints read
HONOURED = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
    "stream", "stream_options", "ignore_eos", "logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids",
    "bad_words", "skip_special_tokens", "include_stop_str_in_output", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "cache_salt",
    "return_tokens_as_token_ids", "mm_processor_kwargs", "media_io_kwargs"})
HONOURED_CHAT = HONOURED | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                            "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}
HONOURED_COMPLETIONS = HONOURED | {"prompt"}
#: fields that only label a request (who sent it, what for): nothing in the answer depends on
#: them, so they are accepted as they are (vLLM ignores ``user`` too)
LABELS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})

#: fields this server does not implement, with the values that mean "not used": any other
#: value is a 400 naming the field, never silently ignored
REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "store": (None, False), "service_tier": (None, "auto", "default"), "moderation": (None,),
    "prompt_cache_retention": (None,), "prompt_cache_options": (None,),
    # vLLM's
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "allowed_token_ids": (None,), "logits_processors": (None,),
    "return_token_ids": (None, False), "kv_transfer_params": (None,),
    "vllm_xargs": (None, {}), "request_id": (None,), "prompt_embeds": (None,),
    "max_repetition_pattern_size": (None, 0), "min_repetition_pattern_size": (None, 0),
    "repetition_min_count": (None, 0),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "documents": (None,), "chat_template": (None,),
    "include_reasoning": (None, True),
}
#: ... and per endpoint: chat's ``add_special_tokens`` is false by default (the template
#: writes them), completions' true; chat's ``top_logprobs``, ``tools``, ``tool_choice`` and
#: ``chat_template_kwargs`` mean nothing on /v1/completions (it takes ``logprobs`` = k and
#: renders no template)
REFUSED_CHAT: dict[str, tuple[Any, ...]] = {"add_special_tokens": (None, False)}
REFUSED_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (None, True), "top_logprobs": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"), "chat_template_kwargs": (None, {})}

KNOWN_CHAT = HONOURED_CHAT | LABELS | REFUSED.keys() | REFUSED_CHAT.keys()
KNOWN_COMPLETIONS = HONOURED_COMPLETIONS | LABELS | REFUSED.keys() | REFUSED_COMPLETIONS.keys()
#: the most unknown names remembered (and logged): a client sending endless new names gets
#: no more log lines past this
MAX_LOGGED = 256
_logged: set[str] = set()
_lock = threading.Lock()


def note_unknown(body: dict[str, Any], chat: bool) -> list[str]:
    """Log the fields of ``body`` that neither API defines, once per name per process (a
    warning: they are ignored, as vLLM ignores them); returns the names logged now."""
    known = KNOWN_CHAT if chat else KNOWN_COMPLETIONS
    unknown = [name for name in body if name not in known]
    if not unknown:
        return []
    new = []
    with _lock:
        for name in unknown:
            shown = name[:64]
            if shown not in _logged and len(_logged) < MAX_LOGGED:
                _logged.add(shown)
                new.append(shown)
    for name in new:
        logger.warning("ignoring the unknown request field %r on %s (as vLLM does; logged "
                       "once per name)", name, "/v1/chat/completions" if chat
                       else "/v1/completions")
    return new
