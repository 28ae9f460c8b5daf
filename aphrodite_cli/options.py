"""Flags shared by several commands, defined once with their help text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from aphrodite_cli.config_flags import option
from engine import envs
from engine.config import MediaPolicy
from engine.media.video.backend_info import NAMES as VIDEO_BACKEND_NAMES

_BACKEND_VAR = "APHRODITE_VIDEO_LOADER_BACKEND"

# The media policy's flags: their help, flag and metavar are MediaPolicy's fields' (one source
# for every command that fetches media)
AllowedMediaDomains = option(MediaPolicy, "allowed_domains", list[str] | None)
AllowedLocalMediaPath = option(MediaPolicy, "allowed_local_path", Path | None)
#: the video backend when none is named: the variable's value, its default declared once
#: (engine/envs.py)
DEFAULT_VIDEO_BACKEND = (f"${_BACKEND_VAR}, or {envs.default(_BACKEND_VAR)} when unset")


def split_hosts(values: list[str] | None) -> list[str]:
    """``--allowed-media-domains a,b --allowed-media-domains c`` -> ``[a, b, c]``."""
    return [h.strip() for v in values or [] for h in v.replace(" ", ",").split(",") if h.strip()]


MediaIoKwargs = Annotated[
    str | None,
    typer.Option(
        "--media-io-kwargs",
        help='JSON of media loading options, e.g. \'{"video": {"backend": "torchcodec", '
        f'"num_frames": 16}}}}\'. Video backends: {", ".join(VIDEO_BACKEND_NAMES)} '
        f"(default: {DEFAULT_VIDEO_BACKEND}).",
        metavar="JSON",
    ),
]


def parse_json_flag(flag: str, text: str | None) -> dict | None:
    """A JSON-object flag; a usage error that shows the bad part otherwise."""
    import json

    from engine.errors import ConfigError

    if text is None or text.strip() == "":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        start = max(exc.pos - 15, 0)
        snippet = text[start: exc.pos + 15]
        raise ConfigError(f"{flag} is not valid JSON: {exc.msg} at position {exc.pos} "
                          f"(near {snippet!r})", hint=f"quote {flag}'s JSON for your shell",
                          code="invalid_json_flag") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, not {type(value).__name__}",
                          code="invalid_json_flag")
    return value


# Choice flags: typed as their choices, so Typer lists them in --help and refuses anything
# else with the flag's name and the bad value (exit 2).
Mode = Literal["cold", "warm", "both"]
MediaDelivery = Literal["data-url", "http"]
TtftFrom = Literal["content", "chunk"]
DatasetName = Literal["random-mm", "jsonl", "random", "trace", "prefix_repetition", "mooncake",
                      "timed_trace", "hf", "sharegpt"]
DecodeIsolation = Literal["process", "thread"]
SweepProfile = Literal["sweep"]
RampUpStrategy = Literal["linear", "exponential"]
BatchingWorkload = Literal["uniform", "mixed"]
OutputFormat = Literal["table", "markdown", "json"]
#: vLLM's --tool-call-parser names this server has (engine/server/api/tool_parsers.py PARSERS)
ToolCallParser = Literal["hermes"]
ModelSizeName = Literal["tiny", "small", "medium"]  # engine.models.sizes.SIZES
OUTPUT_FORMAT_HELP = ("How results are printed: table, markdown (for pull requests and CI "
                      "summaries) or json (for scripts); the result file is the same.")
