"""Request bodies -> typed, validated values (a bad field is a 400 naming it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.executor.logits_processors import check_token_ids
from engine.executor.request import checked_priority
from engine.executor.sampling import MAX_LOGPROBS, MAX_TOKENS_CAP, SamplingParams
from engine.processing.template_kwargs import parse_template_kwargs
from engine.server.api import request_fields
from engine.server.api.structured_fields import constraint
from engine.server.api.tool_fields import ToolChoice, tool_choice


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None
           ) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise InvalidRequestError(f"{name} must be a number", param=name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidRequestError(f"{name} must be {names}", param=name)
    return value


#: the longest ``cache_salt`` accepted, in characters
MAX_CACHE_SALT_CHARS = 1024


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string (its rule), at most MAX_CACHE_SALT_CHARS."""
    salt = _field(body, "cache_salt", str)
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be a non-empty string of at most "
                                  f"{MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def _stream_option(options: dict[str, Any], name: str) -> bool:
    """One of ``stream_options``' switches: a boolean (a string such as "false" would read as
    true), absent meaning false; named in full in an error."""
    qualified = f"stream_options.{name}"
    return _field({qualified: options.get(name)}, qualified, bool, False)


@dataclass
class GenerationFields:
    stream: bool
    include_usage: bool
    #: max_tokens is a placeholder while ``max_tokens`` is None (see :meth:`sampling_for`)
    sampling: SamplingParams
    media_io_kwargs: dict[str, Any] | None
    mm_processor_kwargs: dict[str, Any] | None
    #: None: a chat request that left it out (up to the model's length limit)
    max_tokens: int | None = 16
    max_tokens_cap: int = MAX_TOKENS_CAP
    #: chat's ``logprobs``/``top_logprobs`` or completions' ``logprobs`` asked for
    logprobs: bool = False
    #: vLLM's extension: logprob tokens written ``token_id:<id>``
    tokens_as_ids: bool = False
    #: vLLM's extension: lower values join the running batch first (``--scheduling-policy
    #: priority``)
    priority: int = 0
    #: ``stream_options.continuous_usage_stats`` (vLLM's): usage on every streamed chunk
    continuous_usage: bool = False
    #: vLLM's ``cache_salt``: requests of different salts share no cached work
    cache_salt: str | None = None
    #: the call ``tool_choice`` forces (a named function or ``required``), None for text
    tools: ToolChoice | None = None
    #: vLLM's ``chat_template_kwargs``, checked (:mod:`engine.processing.template_kwargs`)
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_for(self, prompt_tokens: int, max_model_len: int, param: str
                     ) -> SamplingParams:
        """The sampling parameters for one prompt of ``prompt_tokens`` tokens: a request
        without ``max_tokens`` (chat) generates up to the model's length limit, capped by the
        server's max-tokens cap, as OpenAI and vLLM do; prompt plus max_tokens must fit."""
        room = max_model_len - prompt_tokens
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = min(room, self.max_tokens_cap, MAX_TOKENS_CAP)
        if max_tokens < 1 or max_tokens > room:
            what = f"max_tokens ({max_tokens})" if self.max_tokens is not None \
                else "at least one generated token"
            raise InvalidRequestError(
                f"the prompt ({prompt_tokens} tokens) plus {what} is over the model length "
                f"{max_model_len}", hint="shorten the prompt or lower max_tokens",
                code="context_length_exceeded", param=param)
        return dataclasses.replace(self.sampling, max_tokens=max_tokens)


def refuse_unsupported(body: dict[str, Any],
                       table: dict[str, tuple[Any, ...]] = request_fields.REFUSED) -> None:
    """A 400 naming the first field of ``table`` (see engine/server/api/request_fields.py) that
    ``body`` sets to a value other than its "unused" ones."""
    for name, unused in table.items():
        value = body.get(name)
        if not any(value == u and type(value) is type(u) for u in unused) and \
                not (value is None and None in unused):
            raise InvalidRequestError(
                f"{name}={value!r} is not supported by this server", param=name,
                hint=f"leave {name} out of the request", code="unsupported_parameter")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The number of top log-probabilities per token asked for (vLLM's ``logprobs`` k), or
    None for none. Chat: ``logprobs`` true and ``top_logprobs`` 0..20; completions:
    ``logprobs`` 0..20."""
    def top(name: str) -> int:
        value = _field(body, name, int, 0)
        if not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequestError(f"{name}={value!r} must be an integer from 0 to "
                                      f"{MAX_LOGPROBS}", param=name,
                                      code="invalid_sampling_params")
        return value

    if not chat:
        return top("logprobs") if body.get("logprobs") is not None else None
    wanted = bool(_field(body, "logprobs", bool, False))
    k = top("top_logprobs")
    if k and not wanted:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs",
                                  code="invalid_sampling_params")
    return k if wanted else None


def _sampling_extras(body: dict[str, Any]) -> dict[str, Any]:
    """The logits processors' and output fields (vLLM's names; OpenAI's penalties and
    ``logit_bias``), type-checked here, their ranges by SamplingParams."""
    number = (int, float)
    out = {name: _field(body, name, number) for name in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")}
    out.update(logit_bias=_field(body, "logit_bias", dict), min_tokens=_field(
        body, "min_tokens", int), stop_token_ids=_field(body, "stop_token_ids", list),
        bad_words=_field(body, "bad_words", list),
        skip_special_tokens=_field(body, "skip_special_tokens", bool),
        include_stop_str_in_output=_field(body, "include_stop_str_in_output", bool))
    return {name: value for name, value in out.items() if value is not None}


def parse_generation_fields(body: dict[str, Any], *, max_tokens_cap: int, chat: bool = True,
                            scheduling_policy: str = "fcfs", tool_parser: str | None = None,
                            vocab_size: int | None = None,
                            defaults: dict[str, Any] | None = None) -> GenerationFields:
    """The sampling and extension fields shared by chat and text completions. Without
    ``max_tokens``/``max_completion_tokens`` a chat request generates up to the model's length
    limit (resolved per prompt by :meth:`GenerationFields.sampling_for`); a text completion
    generates 16 tokens (OpenAI's and vLLM's default for that endpoint). ``priority`` other
    than 0 is refused unless ``scheduling_policy`` is "priority"; ``tool_parser``: the
    server's tool-call parser (``tool_choice`` "auto" needs one); ``vocab_size``: the
    model's, which ``logit_bias`` and ``stop_token_ids`` must fall in; ``defaults``: the
    sampling values a request that leaves them out gets (``--generation-config``; its
    ``max_tokens`` then bounds the room the answer is given, as the server's cap does)."""
    defaults = dict(defaults or {})
    default_max = defaults.pop("max_tokens", None)
    if defaults:
        body = {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}
    request_fields.note_unknown(body, chat)
    refuse_unsupported(body)
    refuse_unsupported(body, request_fields.REFUSED_CHAT if chat
                       else request_fields.REFUSED_COMPLETIONS)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", int,
                        None if chat or default_max else 16)
    if max_tokens is None and default_max:
        max_tokens_cap = min(max_tokens_cap, default_max)
    if max_tokens is not None and max_tokens > max_tokens_cap:
        raise InvalidRequestError(f"max_tokens={max_tokens} is over this server's cap of "
                                  f"{max_tokens_cap}", param="max_tokens",
                                  code="invalid_sampling_params")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    options = _field(body, "stream_options", dict, {})
    logprobs = _logprobs(body, chat)
    spec = constraint(body)
    tools = tool_choice(body, tool_parser) if chat else None
    if tools is not None:
        if logprobs is not None:
            raise InvalidRequestError("logprobs with tool calls are not supported",
                                      param="logprobs", code="unsupported_parameter",
                                      hint='leave logprobs out, or send tool_choice "none"')
        if tools.spec is not None:
            if spec is not None:
                raise InvalidRequestError(f"tool_choice and {spec.param} each ask for a "
                                          "constraint: one per request", param="tool_choice",
                                          code="invalid_structured_output")
            spec = tools.spec
    sampling = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else MAX_TOKENS_CAP,
        temperature=float(_field(body, "temperature", (int, float), 1.0)),
        top_p=float(_field(body, "top_p", (int, float), 1.0)),
        top_k=_field(body, "top_k", int, 0),
        seed=_field(body, "seed", int, None),
        stop=stop or [],
        n=_field(body, "n", int, 1),
        ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
        logprobs=logprobs,
        structured_outputs=spec,
        **_sampling_extras(body),
    )
    if vocab_size is not None:
        check_token_ids(sampling, vocab_size)
    media = _field(body, "media_io_kwargs", dict, None)
    return GenerationFields(
        stream=bool(_field(body, "stream", bool, False)),
        include_usage=_stream_option(options, "include_usage"),
        continuous_usage=_stream_option(options, "continuous_usage_stats"),
        sampling=sampling,
        media_io_kwargs=media,
        mm_processor_kwargs=_field(body, "mm_processor_kwargs", dict, None),
        max_tokens=max_tokens,
        max_tokens_cap=max_tokens_cap,
        logprobs=logprobs is not None,
        tokens_as_ids=bool(_field(body, "return_tokens_as_token_ids", bool, False)),
        priority=checked_priority(_field(body, "priority", int, 0), scheduling_policy),
        tools=tools,
        cache_salt=_cache_salt(body),
        chat_template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs"))
        if chat else None,
    )


#: prompts one /v1/completions request may carry (each is one engine request of ``n`` rows)
MAX_PROMPTS = 64

PromptInput = str | list[int]


def too_many_prompts(count: int) -> InvalidRequestError:
    return InvalidRequestError(f"prompt holds {count} prompts; at most {MAX_PROMPTS} per "
                               "request", param="prompt", hint="send several requests",
                               code="too_many_prompts")


def parse_prompts(prompt: Any, vocab_size: int, forbidden_ids: set[int] = frozenset()
                  ) -> list[PromptInput]:
    """``/v1/completions``' ``prompt``: a string, a list of strings, a list of token ids or a
    list of lists of token ids, as the list of prompts it stands for. Token ids must be in
    the vocabulary (0 <= id < ``vocab_size``) and not a media placeholder's (``forbidden_ids``:
    a prompt of ids carries no media)."""
    shape = ("prompt must be a string, a list of strings, a list of token ids or a list of "
             "lists of token ids")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(shape + ("" if prompt != [] else " (it is empty)"),
                                  param="prompt")
    if all(_is_id(t) for t in prompt):
        prompts: list[PromptInput] = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise InvalidRequestError(shape, param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise too_many_prompts(len(prompts))
    for p in prompts:
        if isinstance(p, str):
            continue
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} in prompt is out of the vocabulary "
                                      f"(0 to {vocab_size - 1})", param="prompt",
                                      code="invalid_token_id")
        media = next((t for t in p if t in forbidden_ids), None)
        if media is not None:
            raise InvalidRequestError(f"token id {media} in prompt is a media placeholder; a "
                                      "prompt of token ids carries no media", param="prompt",
                                      code="invalid_token_id")
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
