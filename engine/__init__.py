"""aphrodite's shared engine: media fetching and decoding, preprocessing, execution.

Kept import-light: heavy parts (torch, transformers, decoders) load only when used.
"""

from engine.version import __version__

__all__ = ["__version__"]
