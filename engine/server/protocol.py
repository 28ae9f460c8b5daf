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


def parse_generation_fields(body: dict[str, Any], *, max_tokens_cap: int) -> GenerationFields:
    """The sampling and extension fields shared by chat and text completions."""
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
