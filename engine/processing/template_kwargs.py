"""vLLM's ``chat_template_kwargs``: extra variables a chat request gives the chat template
(``{"enable_thinking": false}``, Qwen-VL's ``{"add_vision_id": true}``).

They are client input written into the prompt, so they are bounded before anything renders
(:func:`parse_template_kwargs`): an object of at most :data:`MAX_KEYS` names (Jinja
identifiers), its values JSON (strings, numbers, booleans, null, and lists or objects of
them up to :data:`MAX_DEPTH` deep), :data:`MAX_BYTES` of JSON in all. A name this server
passes the template itself (``messages``, ``tools``, ``add_generation_prompt``...), a
parameter of Hugging Face's ``apply_chat_template`` (``tokenize``, ``chat_template``...), a
special token's name (``bos_token``: the template writes it as a control token) or one of
the template's globals (``raise_exception``) is a 400 naming it: a request cannot replace
what the server renders. Their strings are held to the rule of message text (no control
token; see :func:`engine.processing.prompt.render_chat`).

The template gets only the names it reads (:func:`template_variables`, as vLLM's
``resolve_chat_template_kwargs`` keeps them): another name cannot change the prompt, and
Hugging Face would take it for a processor argument. Such a name is logged once per name, as
an unknown request field is, and the request is answered (one ``--extra-body`` goes to
every model of a benchmark, whether its template reads ``enable_thinking`` or not).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from typing import Any

from engine.errors import InvalidRequestError

logger = logging.getLogger("aphrodite.server")
PARAM = "chat_template_kwargs"
#: the most names, the most JSON bytes (values included) and the deepest nesting one
#: request's ``chat_template_kwargs`` may hold
MAX_KEYS = 32
MAX_BYTES = 8192
MAX_DEPTH = 4
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: names a request may not set: what this server passes the template itself, Hugging
#: Face's ``apply_chat_template`` parameters, the tokenizer's special tokens (the template
#: writes them as control tokens) and the template environment's globals
RESERVED = frozenset({
    "messages", "conversation", "conversations", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "processor_kwargs", "load_audio_from_video",
    "sanitize_control_tokens", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens", "raise_exception",
    "strftime_now", "namespace", "range", "dict", "lipsum", "cycler", "joiner",
})
#: the most unused names remembered (and logged)
MAX_LOGGED = 256
_logged: set[str] = set()
_lock = threading.Lock()


def _bad(message: str, code: str = "invalid_chat_template_kwargs", hint: str | None = None
         ) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}: {message}", param=PARAM, code=code,
                               hint=hint or f"send {PARAM} as an object of template variables "
                                            '(e.g. {"enable_thinking": false})')


def _check_value(name: str, value: Any, depth: int) -> None:
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise _bad(f"{name} is not a finite number")
        return
    if depth >= MAX_DEPTH:
        raise _bad(f"{name} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for item in value:
            _check_value(name, item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad(f"{name} has a key that is not a string")
            _check_value(name, item, depth + 1)
        return
    raise _bad(f"{name} is not a JSON value")


def parse_template_kwargs(value: Any) -> dict[str, Any] | None:
    """A request's ``chat_template_kwargs`` checked (see the module's rules), or None when
    left out or empty; a 400 naming the field (and the offending name) otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("must be an object")
    if not value:
        return None
    if len(value) > MAX_KEYS:
        raise _bad(f"holds {len(value)} names, over the limit of {MAX_KEYS}")
    for name, item in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{str(name)[:64]!r} is not a template variable name (letters, digits "
                       "and _, up to 64, not starting with a digit)")
        if name in RESERVED:
            raise _bad(f"{name!r} is set by the server, not by a request",
                       code="reserved_template_variable",
                       hint=f"leave {name} out of {PARAM}" + (
                           " (the server's --chat-template sets the template)"
                           if name == "chat_template" else ""))
        _check_value(name, item, 1)
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_BYTES:
        raise _bad(f"is {size} bytes of JSON, over the limit of {MAX_BYTES}")
    return dict(value)


def kwargs_strings(value: Any) -> list[str]:
    """Every string in a checked ``chat_template_kwargs`` value (for the control-token rule)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in kwargs_strings(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in kwargs_strings(item)]
    return []


@functools.lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables ``template`` reads and does not set itself (Jinja's
    ``find_undeclared_variables``, parsed in Hugging Face's template environment so its
    extensions parse), or None when it cannot be parsed here (then every name is given)."""
    import jinja2
    import jinja2.meta

    try:  # (Hugging Face's environment: its ``{% generation %}`` tag parses too)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
    except Exception:
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except Exception:
        return None


def for_template(template: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The checked ``kwargs`` the template reads; the other names logged once each."""
    if not kwargs:
        return {}
    names = template_variables(template)
    if names is None:
        return dict(kwargs)
    unused = [name for name in kwargs if name not in names]
    if unused:
        new = []
        with _lock:
            for name in unused:
                if name not in _logged and len(_logged) < MAX_LOGGED:
                    _logged.add(name)
                    new.append(name)
        for name in new:
            logger.warning("%s: the chat template does not read %r; it is left out (as vLLM "
                           "does; logged once per name)", PARAM, name)
    return {name: value for name, value in kwargs.items() if name in names}
