"""What a model folder's checkpoint holds, read without loading it: its parameter count from
the safetensors headers (``serve --data-parallel-size auto`` decides from it before any
engine loads the weights)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

#: the largest safetensors header read (the format's own limit is 100 MB)
MAX_HEADER_BYTES = 100 << 20


def parameters(folder: Path) -> int | None:
    """The parameters of the ``*.safetensors`` files in ``folder`` (each tensor's shape
    multiplied out), or None where there are none or a header cannot be read."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > MAX_HEADER_BYTES:
                    return None
                header = json.loads(f.read(size))
            total += sum(math.prod(entry["shape"]) for name, entry in header.items()
                         if name != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None
    return total
