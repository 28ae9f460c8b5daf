"""Request bodies -> typed, validated values (a bad field is a 400 naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.executor.sampling import SamplingParams


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


@dataclass
class GenerationFields:
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    media_io_kwargs: dict[str, Any] | None
    mm_processor_kwargs: dict[str, Any] | None


#: OpenAI parameters this server does not implement, with the value that means "not used":
#: any other value is a 400 naming the parameter, never silently ignored (a client asking for
#: JSON output or tool calls must not get free text as if it had been honoured).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name, unused in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == u and type(value) is type(u) for u in unused) and \
                not (value is None and None in unused):
            raise InvalidRequestError(
                f"{name}={value!r} is not supported by this server", param=name,
                hint=f"leave {name} out of the request", code="unsupported_parameter")


def parse_generation_fields(body: dict[str, Any], *, max_tokens_cap: int) -> GenerationFields:
    """The sampling and extension fields shared by chat and text completions."""
    refuse_unsupported(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", int, 16)
    if max_tokens > max_tokens_cap:
        raise InvalidRequestError(f"max_tokens={max_tokens} is over this server's cap of "
                                  f"{max_tokens_cap}", param="max_tokens",
                                  code="invalid_sampling_params")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    options = _field(body, "stream_options", dict, {})
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (int, float), 1.0)),
        top_p=float(_field(body, "top_p", (int, float), 1.0)),
        top_k=_field(body, "top_k", int, 0),
        seed=_field(body, "seed", int, None),
        stop=stop or [],
        n=_field(body, "n", int, 1),
        ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
    )
    media = _field(body, "media_io_kwargs", dict, None)
    return GenerationFields(
        stream=bool(_field(body, "stream", bool, False)),
        include_usage=bool(options.get("include_usage", False)),
        sampling=sampling,
        media_io_kwargs=media,
        mm_processor_kwargs=_field(body, "mm_processor_kwargs", dict, None),
    )
