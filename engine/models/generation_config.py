"""The model's own sampling defaults, from its ``generation_config.json`` (vLLM's
``--generation-config``).

``auto`` (vLLM's default) reads the model folder's file, ``vllm`` uses none (the neutral
defaults), any other value names a folder holding a ``generation_config.json``. As vLLM's
``ModelConfig.get_diff_sampling_param``: the values that differ from transformers'
``GenerationConfig`` defaults count (in transformers 5 every one of these defaults to None,
so every value the file sets), only ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``) are taken, and a request
that sends one of them overrides it. The file is read as JSON (the supervisor that reads it
never imports transformers); the values are checked by the caller as a request's would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ConfigError

#: vLLM's list of the generation config's sampling fields, under its request names
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                   "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")
FLAG = "--generation-config"


def sampling_defaults(mode: str, model_path: Path | str) -> dict[str, Any]:
    """The request defaults ``mode`` (``auto``, ``vllm`` or a folder) gives for a model in
    ``model_path``: {request field: value}, empty when there are none. A folder that does
    not exist, or a file that is not a generation config, is a ConfigError naming the
    flag."""
    if mode == "vllm":
        return {}
    folder = Path(model_path) if mode == "auto" else Path(mode)
    if mode != "auto" and not folder.is_dir():
        raise ConfigError(f"{FLAG} {mode!r} is neither auto, vllm nor a folder",
                          hint=f"pass {FLAG} auto, vllm, or a folder holding a "
                               "generation_config.json", code="bad_generation_config")
    if not (folder / "generation_config.json").is_file():
        if mode == "auto":
            return {}
        raise ConfigError(f"{FLAG} folder {mode!r} holds no generation_config.json",
                          hint=f"pass {FLAG} auto or vllm", code="bad_generation_config")
    import json

    path = folder / "generation_config.json"
    try:
        diff = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise bad_file(path, str(err)) from None
    if not isinstance(diff, dict):
        raise bad_file(path, "not a JSON object")
    return {name: diff[key] for key, name in SAMPLING_FIELDS.items()
            if diff.get(key) is not None}


def bad_file(path: Path | str, why: str) -> ConfigError:
    return ConfigError(f"{FLAG}: {path} cannot be used ({why.splitlines()[0][:200]})",
                       hint=f"fix the file, or pass {FLAG} vllm", code="bad_generation_config")


def describe(defaults: dict[str, Any], mode: str) -> str:
    """The start-up log line (vLLM logs the same once)."""
    source = "the model's generation_config.json" if mode == "auto" else mode
    return (f"Default sampling parameters from {source}: {defaults} (a request's own values "
            f"override them; {FLAG} vllm turns them off)")
