"""aphrodite's shared engine: media fetching and decoding, preprocessing, execution.

Kept import-light: heavy parts (torch, transformers, decoders) load only when used;
``from engine import LLM, SamplingParams`` imports them on first access.
"""

from typing import Any

from engine.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.executor.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
