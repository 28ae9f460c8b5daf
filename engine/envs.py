"""Every ``APHRODITE_*`` environment variable, in one place.

Each variable is declared once below with its type, default and documentation. Values are read
when asked for (``envs.APHRODITE_IMAGE_FETCH_TIMEOUT``), so a test or a launcher can set them
before use. A value that does not parse raises :class:`~engine.errors.ConfigError` naming the
variable; :func:`warn_unknown` warns about ``APHRODITE_*`` names that are declared nowhere
(usually a typo).
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

PREFIX = "APHRODITE_"
#: APHRODITE_VIDEO_LOADER_BACKEND's choices: the names of ``engine.media.video.backend_info``'s
#: records, spelled here because this module imports nothing above it (a test holds the two
#: equal)
VIDEO_BACKENDS = ("opencv", "pyav", "torchcodec", "pynvvideocodec", "deepstream")


@dataclass(frozen=True)
class EnvVar:
    """Declaration of one environment variable."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    kind: str


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _video_backend(raw: str) -> str:
    value = raw.strip().lower()
    if value not in VIDEO_BACKENDS:
        raise ValueError(f"must be one of {', '.join(VIDEO_BACKENDS)}")
    return value


def _rgb(raw: str) -> tuple[int, int, int]:
    text = raw.strip().lstrip("#")
    if len(text) == 6 and all(c in "0123456789abcdefABCDEF" for c in text):
        return (int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16))
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
        raise ValueError("must be R,G,B with each 0-255, or a hex colour like #ffffff")
    return (parts[0], parts[1], parts[2])


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
    return value


_MIB = 1024 * 1024

_DECLARED: tuple[EnvVar, ...] = (
    EnvVar("APHRODITE_IMAGE_FETCH_TIMEOUT", 10.0, _positive_float,
           "Seconds to fetch one image, retries included.", "seconds"),
    EnvVar("APHRODITE_VIDEO_FETCH_TIMEOUT", 30.0, _positive_float,
           "Seconds to fetch one video, retries included.", "seconds"),
    EnvVar("APHRODITE_AUDIO_FETCH_TIMEOUT", 10.0, _positive_float,
           "Seconds to fetch one audio clip, retries included.", "seconds"),
    EnvVar("APHRODITE_MEDIA_FETCH_RETRIES", 2, _non_negative_int,
           "Retries after a timeout, connection error or 5xx (within the fetch timeout).", "int"),
    EnvVar("APHRODITE_MEDIA_MAX_REDIRECTS", 3, _non_negative_int,
           "Redirects followed per media fetch; each hop is checked against the policy.", "int"),
    EnvVar("APHRODITE_MAX_IMAGE_BYTES", 20 * _MIB, _positive_int,
           "Largest image accepted, in bytes (after any HTTP decompression).", "bytes"),
    EnvVar("APHRODITE_MAX_VIDEO_BYTES", 256 * _MIB, _positive_int,
           "Largest video accepted, in bytes.", "bytes"),
    EnvVar("APHRODITE_MAX_AUDIO_BYTES", 32 * _MIB, _positive_int,
           "Largest audio clip accepted, in bytes.", "bytes"),
    EnvVar("APHRODITE_MAX_IMAGE_PIXELS", 40_000_000, _positive_int,
           "Largest image accepted, in pixels (width x height), checked before decoding.",
           "pixels"),
    EnvVar("APHRODITE_MAX_JPEG_SCAN_PIXELS", 16 * 40_000_000, _positive_int,
           "Most decode work a progressive JPEG may ask for, as its scans x pixels, counted "
           "from its markers before decoding (a normal one has about 10 scans).",
           "scan-pixels"),
    EnvVar("APHRODITE_IMAGE_BACKGROUND", (255, 255, 255), _rgb,
           "Colour that transparent images are composited onto: R,G,B or #rrggbb.", "colour"),
    EnvVar("APHRODITE_MAX_AUDIO_SECONDS", 600.0, _positive_float,
           "Longest audio clip accepted, in seconds.", "seconds"),
    EnvVar("APHRODITE_MAX_AUDIO_DECODE_SAMPLES", 600 * 48_000 * 2, _positive_int,
           "Most samples (all channels, at the source rate) one audio clip may decode: "
           "estimated from its header before decoding, then counted while decoding.",
           "samples"),
    EnvVar("APHRODITE_MAX_VIDEO_FRAME_PIXELS", 4096 * 2304, _positive_int,
           "Largest video frame accepted, in pixels (width x height), checked before decoding.",
           "pixels"),
    EnvVar("APHRODITE_MAX_VIDEO_FRAMES", 100_000, _positive_int,
           "Most frames a video may have (counted from its packets, before decoding).", "int"),
    EnvVar("APHRODITE_MAX_VIDEO_DECODED_BYTES", 2 * 1024 * _MIB, _positive_int,
           "Most bytes of RGB frames one video may decode to (sampled frames x W x H x 3).",
           "bytes"),
    EnvVar("APHRODITE_MEDIA_LOADING_THREAD_COUNT", 8, _positive_int,
           "Threads that decode media off the event loop.", "int"),
    EnvVar("APHRODITE_API_SERVER_TORCH_THREADS", 1, _positive_int,
           "torch intra-op threads in each API server process (the HF processor's tensor "
           "work); requests already run in parallel there, so more threads mostly contend "
           "with the engine for cores.", "int"),
    EnvVar("APHRODITE_CPU_ONEDNN_LINEAR", True, _bool,
           "Run a CPU model's float32 linear layers through oneDNN with weights packed at "
           "load (about 2.5x MKL's speed on AMD CPUs; the packed copy doubles those layers' "
           "memory); 0 keeps PyTorch's default.", "bool"),
    EnvVar("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", 1 << 19, _non_negative_int,
           "Smallest weight (in elements, in x out) a linear layer packs for oneDNN: a "
           "oneDNN call costs about 25 us more than PyTorch's own, which a small layer "
           "never wins back (scripts/cpu_linear_bench.py measures both).", "elements"),
    EnvVar("APHRODITE_LEAN_DECODE", True, _bool,
           "Run a CPU decode step of a Qwen2/Qwen2-VL/Qwen2.5-VL/Llama text model layer by "
           "layer on its weights, without transformers' module machinery (the same logits; 30% "
           "less time a step on a small model); 0 runs the model's own forward.", "bool"),
    EnvVar("APHRODITE_LEAN_DECODE_FUSED", True, _bool,
           "In the lean decode step, each layer's q/k/v products as one product and its "
           "gate/up products as one, over weights concatenated once at load; 0 runs them one "
           "by one.", "bool"),
    EnvVar("APHRODITE_DECODE_ATTENTION_KERNEL", True, _bool,
           "Run a CPU decode step's attention through the engine's own C kernel (built at "
           "model load with the machine's C compiler, cc, gcc or clang, once into the cache), "
           "which reads each key and value once and skips padding; 0 (or no compiler) runs "
           "two batched products.",
           "bool"),
    EnvVar("APHRODITE_DECODE_LINEAR_KERNEL", True, _bool,
           "Run a CPU decode step's float32 linear products, and the small operations "
           "between them, through the engine's own C kernels (built with the attention "
           "kernel), over a copy of each weight packed at load into panels streamed at the "
           "memory's speed (memory: one more copy of the output, down and head weights); 0 "
           "(or no compiler) runs oneDNN's or PyTorch's products.",
           "bool"),
    EnvVar("APHRODITE_DECODE_STEP_KERNEL", True, _bool,
           "Run a CPU decode step's decoder layers in one call into the engine's C kernels "
           "(the same kernels, in the same order, as one call each from Python: the same "
           "results without the Python between them), where the linear kernel runs every "
           "product; 0 calls them one by one.",
           "bool"),
    EnvVar("APHRODITE_VIDEO_LOADER_BACKEND", "opencv", _video_backend,
           f"Default video decoder: one of {', '.join(VIDEO_BACKENDS)}.", "name"),
    EnvVar("APHRODITE_API_KEY", "", str,
           "API key the server requires (Authorization: Bearer KEY); --api-key wins.", "text"),
    EnvVar("APHRODITE_ADMIN_API_KEY", "", str,
           "Key of the admin routes (/reset_mm_cache, /reset_prefix_cache), apart from the "
           "API key; --admin-api-key wins. Without it or APHRODITE_SERVER_DEV_MODE those "
           "routes are off.", "text"),
    EnvVar("APHRODITE_SERVER_DEV_MODE", False, _bool,
           "Open the admin routes (cache resets) to API key holders without an admin key, as "
           "vLLM's VLLM_SERVER_DEV_MODE; --server-dev-mode too.", "bool"),
    EnvVar("APHRODITE_CACHE_ROOT", "", str,
           "Folder for built tiny models and other caches (default ~/.cache/aphrodite).",
           "path"),
    EnvVar("APHRODITE_LOGGING_LEVEL", "INFO", _log_level,
           "Log level: DEBUG, INFO, WARNING or ERROR.", "name"),
    EnvVar("APHRODITE_DEBUG", False, _bool,
           "Show full tracebacks on the command line instead of one-line errors.", "bool"),
    EnvVar("APHRODITE_FAIL_WITHOUT_GPU", False, _bool,
           "Tests that need a GPU fail instead of skipping when none is present.", "bool"),
)

DECLARED: dict[str, EnvVar] = {var.name: var for var in _DECLARED}


def default(name: str) -> Any:
    """A declared variable's default: the value a setting it overrides starts from (written
    once, here)."""
    return DECLARED[name].default


def get(name: str) -> Any:
    """The parsed value of a declared variable (its default when unset or empty)."""
    try:
        var = DECLARED[name]
    except KeyError:
        raise AttributeError(f"{name} is not a declared APHRODITE_* variable") from None
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{name}={raw!r} is invalid: {exc}",
            hint=f"unset {name} or set it to a valid {var.kind} (default {var.default!r})",
            code="invalid_env_var",
        ) from None


def __getattr__(name: str) -> Any:
    if name.startswith(PREFIX):
        return get(name)
    raise AttributeError(name)


def unknown_names(environ: dict[str, str] | None = None) -> list[str]:
    """``APHRODITE_*`` names set in the environment that no declaration knows."""
    env = os.environ if environ is None else environ
    return sorted(n for n in env if n.startswith(PREFIX) and n not in DECLARED)


def warn_unknown(environ: dict[str, str] | None = None) -> list[str]:
    """Warn once per unknown ``APHRODITE_*`` name, suggesting the closest declared one."""
    names = unknown_names(environ)
    for name in names:
        close = difflib.get_close_matches(name, DECLARED, n=1)
        tip = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"unknown environment variable {name} is ignored{tip}", stacklevel=2)
    return names


def validate_all() -> None:
    """Parse every declared variable now, so a bad value fails at startup, not mid-request."""
    for name in DECLARED:
        get(name)


def markdown_table() -> str:
    """docs/environment.md's table of variables (``python -m engine.envs`` prints it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for var in DECLARED.values():
        default = var.default if var.default != "" else "(unset)"
        rows.append(f"| `{var.name}` | `{default}` | {var.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
