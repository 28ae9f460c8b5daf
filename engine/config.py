"""Typed configuration objects. The CLI builds these from flags; the core sees nothing else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine import envs
from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.media.video.options import VideoLoadSpec

Modality = Literal["image", "video", "audio"]
MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")


def normalize_host(host: str) -> str:
    """Lower-case, IDNA-encoded, without a trailing dot or IPv6 brackets: the form compared."""
    host = host.strip().strip("[]").rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        return host


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from: the operator's allow-lists.

    ``allowed_domains``: exact host names (after :func:`normalize_host`). When non-empty only
    these hosts are fetched; a listed host may also resolve to private addresses. When empty
    any host on a public address is fetched.
    ``allowed_local_path``: the only folder ``file://`` URLs may read; ``None`` refuses them.
    """

    allowed_domains: frozenset[str] = frozenset()
    allowed_local_path: Path | None = None
    max_redirects: int = 3

    @classmethod
    def create(
        cls,
        *,
        allowed_domains: list[str] | tuple[str, ...] | None = None,
        allowed_local_path: str | os.PathLike[str] | None = None,
        max_redirects: int | None = None,
    ) -> MediaPolicy:
        """Validate operator input: the local folder must exist and be a directory."""
        domains = frozenset(normalize_host(d) for d in (allowed_domains or ()) if d.strip())
        local: Path | None = None
        if allowed_local_path is not None and str(allowed_local_path) != "":
            candidate = Path(allowed_local_path).expanduser()
            if not candidate.exists():
                raise ConfigError(
                    f"--allowed-local-media-path {candidate} does not exist",
                    hint="create the folder or point --allowed-local-media-path at one that exists",
                )
            if not candidate.is_dir():
                raise ConfigError(
                    f"--allowed-local-media-path {candidate} is not a directory",
                    hint="pass a folder, not a file, to --allowed-local-media-path",
                )
            local = candidate.resolve(strict=True)
        redirects = envs.APHRODITE_MEDIA_MAX_REDIRECTS if max_redirects is None else max_redirects
        return cls(allowed_domains=domains, allowed_local_path=local, max_redirects=redirects)


@dataclass(frozen=True)
class ModalityLimits:
    """Caps for one modality."""

    max_bytes: int
    fetch_timeout_s: float


@dataclass(frozen=True)
class MediaLimits:
    """Byte, time, pixel and duration caps for media, per modality."""

    image: ModalityLimits
    video: ModalityLimits
    audio: ModalityLimits
    max_image_pixels: int
    max_audio_seconds: float
    max_video_frame_pixels: int = 4096 * 2304
    max_video_frames: int = 100_000
    max_video_decoded_bytes: int = 2 << 30
    fetch_retries: int = 2
    max_jpeg_scan_pixels: int = 16 * 40_000_000
    max_audio_decode_samples: int = 600 * 48_000 * 2
    image_background: tuple[int, int, int] = field(default=(255, 255, 255))

    def for_modality(self, modality: Modality) -> ModalityLimits:
        return getattr(self, modality)

    @classmethod
    def from_env(cls, **overrides: object) -> MediaLimits:
        """Defaults from the ``APHRODITE_*`` variables; keyword overrides win."""
        per_modality = {
            m: ModalityLimits(envs.get(f"APHRODITE_MAX_{m.upper()}_BYTES"),
                              envs.get(f"APHRODITE_{m.upper()}_FETCH_TIMEOUT"))
            for m in MODALITIES
        }
        limits = cls(
            **per_modality,
            max_image_pixels=envs.APHRODITE_MAX_IMAGE_PIXELS,
            max_audio_seconds=envs.APHRODITE_MAX_AUDIO_SECONDS,
            max_video_frame_pixels=envs.APHRODITE_MAX_VIDEO_FRAME_PIXELS,
            max_video_frames=envs.APHRODITE_MAX_VIDEO_FRAMES,
            max_video_decoded_bytes=envs.APHRODITE_MAX_VIDEO_DECODED_BYTES,
            fetch_retries=envs.APHRODITE_MEDIA_FETCH_RETRIES,
            max_jpeg_scan_pixels=envs.APHRODITE_MAX_JPEG_SCAN_PIXELS,
            max_audio_decode_samples=envs.APHRODITE_MAX_AUDIO_DECODE_SAMPLES,
            image_background=envs.APHRODITE_IMAGE_BACKGROUND,
        )
        return replace(limits, **overrides) if overrides else limits  # type: ignore[arg-type]


#: Who may set which ``mm_processor_kwargs`` per request: "any" key the processor takes (the
#: offline LLM: its caller is the operator), or only the bounded few a server's clients may
#: (``engine.processing.kwargs.REQUEST_KWARGS``).
RequestKwargs = Literal["any", "bounded"]


@dataclass(frozen=True)
class PipelineConfig:
    """The request pipeline's settings, resolved once where they enter (the ``serve`` flags,
    ``LLM(...)``'s arguments): the media policy and the video options as checked, typed
    objects; frozen and picklable, so the start-up check and every API server get the very
    objects the flags became. Built and checked by
    :func:`~engine.processing.pipeline.pipeline_config` (this module holds data only: it
    imports nothing above it). What needs the model (the item limits capped by the family's,
    the processor kwargs checked against its processor) is resolved by the
    :class:`~engine.processing.pipeline.Pipeline` built from this and the model."""

    policy: MediaPolicy = field(default_factory=MediaPolicy.create)
    #: None: the server-wide default (``APHRODITE_VIDEO_LOADER_BACKEND``), which the
    #: Pipeline resolves
    video: VideoLoadSpec | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_cache_gb: float = 4.0
    #: encoded media kept per client media ``uuid`` (engine.processing.media_uuids), in GB
    mm_uuid_cache_gb: float = 1.0
    request_kwargs: RequestKwargs = "any"
    #: rescale + normalize pixels on the model's device where the family allows (vLLM's
    #: --mm-device-do-normalize, on by default as there)
    mm_device_do_normalize: bool = True


#: How rows join a running batch: between decode steps ("continuous"), or only once the
#: batch has ended ("static", the baseline ``bench batching`` compares against)
Scheduling = Literal["continuous", "static"]
SCHEDULING: tuple[Scheduling, ...] = ("continuous", "static")
#: Which waiting rows join first (vLLM's ``--scheduling-policy``): "fcfs", the oldest;
#: "priority", the lowest request ``priority`` (vLLM's request field, 0 by default), the
#: oldest among equals; "shortest", the fewest prompt tokens left to prefill (after the
#: prefix cache), the oldest among equals, except that a row passed over
#: :data:`MAX_OVERTAKES` times goes before every younger one (ours: a video prompt does not
#: hold up the image and text prompts behind it, and is not held up for ever either); under
#: every policy, so under "priority" a low value waits at most that many joins of younger ones
SchedulingPolicy = Literal["fcfs", "priority", "shortest"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority", "shortest")
#: every ``--scheduling-policy``: how many times younger rows may join before a waiting row
#: (after that it goes first): a long prompt, or a low priority, waits at most this many joins
MAX_OVERTAKES = 4
#: the request ``priority`` values accepted (vLLM takes any integer; ours are bounded so a
#: request cannot send a megabyte-long number)
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``--quantization`` methods (vLLM's flag): "int8" packs the language model's linear weights
#: at load as int8 rows with a scale each, dequantized in the product (weight-only; a CPU
#: device); unset: the weights as loaded
QUANTIZATIONS = ("int8",)


def _check_count(flag: str, value: object, *, optional: bool, example: str) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} must be a whole number of at least 1, not {value!r}",
                          hint=f"e.g. {flag} {example}"
                          + (" (or leave it out)" if optional else ""), code="invalid_flag")


def _check_size(flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1 << 20:
        raise ConfigError(f"{flag} must be a size in GB of 0 or more, not {value!r}",
                          hint=f"e.g. {flag} 0.5 (0 turns the cache off)", code="invalid_flag")


#: ``max_num_batched_tokens`` when none is given, per device kind: vLLM's defaults for its
#: OpenAI server (2048 on a CPU; 8192 on a GPU, where vLLM also uses 2048 below 70 GiB). A
#: burst of requests is then prefilled a budget's worth per step, first come first served,
#: while the rows already running decode between steps: the first requests get their first
#: token sooner than if every waiting prompt were prefilled in one pass (measured with the
#: small Qwen2.5-VL at concurrency 8, cold: TTFT p50 1991 ms instead of 3551 ms, the same
#: requests/s).
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


#: ``prefill_pass_tokens`` when none is given, per device kind: the most tokens (padding
#: included) one prefill forward pass of several rows holds. On a CPU a pass of a few hundred
#: tokens runs its products at full speed: measured on the small (43 M) Qwen2.5-VL with one
#: thread, four media rows of 105-402 tokens took 2.5-3.1 s in one step either way, but
#: prefilled a row per pass, their first tokens went out at 0.3, 1.1, 2.4 and 3.1 s instead
#: of all at 3.1 s; eight short text rows cost the same together or apart within noise. On
#: a GPU a pass runs far below its throughput with one row: no bound.
DEFAULT_PASS_TOKENS: dict[str, int | None] = {"cpu": 256, "cuda": None}


#: the smallest model the engine prefills beside its decode steps by default (see
#: ``EngineConfig.overlaps_prefill``): measured with scripts/peer_vllm.sh's loads, a 43 M
#: parameter Qwen2.5-VL served 1.08-1.17x the requests/s with it, a 0.5 M one 0.90-0.97x
MIN_OVERLAP_PARAMETERS = 10_000_000


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings: what the ``serve`` flags, ``LLM(...)``'s arguments and the
    benchmarks ask of the engine, checked here once (a bad value is a :class:`ConfigError`
    naming its flag), frozen and handed whole to the engine process. The CLI's defaults are
    these fields' defaults: a default is written here and nowhere else.

    ``max_num_seqs``: rows in the running batch (a request's ``n`` samples are ``n`` rows).
    ``max_num_batched_tokens``: prompt tokens prefilled in one step; a longer prompt is
    prefilled alone, a chunk per step. ``None``: vLLM's defaults for its OpenAI server,
    :data:`DEFAULT_BATCHED_TOKENS` per device kind (see :attr:`token_budget`).
    ``prefill_pass_tokens``: the most tokens (padding included) one prefill forward pass
    of several rows holds; a step's rows beyond it go in further passes, and each pass
    hands its rows' first tokens out as it ends. ``None``: :data:`DEFAULT_PASS_TOKENS` per
    device kind (see :attr:`pass_tokens`).
    ``scheduling``: see :data:`Scheduling`.
    ``scheduling_policy``: which waiting rows join first, see :data:`SchedulingPolicy`.
    ``device``, ``dtype``: where the model runs, and its weights' type.
    ``num_threads``: torch threads of the engine's process; ``None``: the CPUs the process
    may use (its affinity, at most its cgroup's CPU quota; torch itself counts all cores).
    ``decode_threads``: torch threads of its decode steps (llama.cpp's ``--threads`` beside
    its ``--threads-batch``), ``num_threads`` running the rest (encoders, prefills); ``None``:
    ``num_threads``. A decode step's products are a few rows against every weight: on a
    small model and few cores, splitting them over threads costs more than it saves. Each
    thread keeps its own count: a prefill beside the decode steps (``overlap_prefill``) runs
    on ``num_threads``.
    ``reserved_gpu_bytes``: GPU memory the engine leaves to others (the API servers' video
    decoders): its allocator is capped at the device's total minus this.
    ``enable_prefix_caching``: keep the keys and values of prompts' leading blocks (text, and
    media by their content) for later prompts that start the same way (vLLM's default).
    ``prefix_cache_gb``, ``encoder_cache_gb``: the prefix cache's and the encoder output
    cache's bounds in GiB, on the model's device (0 turns a cache off).
    ``block_size``: tokens per prefix-cache block (vLLM's ``--block-size``): a prompt's
    cached prefix is a whole number of blocks.
    ``overlap_prefill``: prefill rows that join on a second thread while the running rows
    keep decoding (see :meth:`overlaps_prefill`); ``None``: where it pays.
    ``quantization``: see :data:`QUANTIZATIONS`; ``None``: off.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    prefill_pass_tokens: int | None = None
    scheduling: Scheduling = "continuous"
    scheduling_policy: SchedulingPolicy = "fcfs"
    device: str = "cpu"
    dtype: str = "auto"
    num_threads: int | None = None
    decode_threads: int | None = None
    reserved_gpu_bytes: int = 0
    enable_prefix_caching: bool = True
    prefix_cache_gb: float = 0.5
    encoder_cache_gb: float = 0.25
    block_size: int = 16
    overlap_prefill: bool | None = None
    quantization: str | None = None

    def overlaps_prefill(self, cpus: int, parameters: int) -> bool:
        """Whether the engine prefills beside its decode steps (on a process that may use
        ``cpus`` CPUs, for a model of ``parameters``): as set, else on a CPU device when its
        threads leave the cores for both (see :meth:`oversubscribes`; by default
        ``--num-threads`` at most half the CPUs: torch's own threads already fill them
        otherwise, and a GPU runs one kernel stream either way) and the model has
        :data:`MIN_OVERLAP_PARAMETERS` or more (a smaller model's steps are mostly Python,
        which holds the GIL: two threads then take turns instead of running together)."""
        if self.overlap_prefill is not None:
            return self.overlap_prefill
        return str(self.device) == "cpu" and not self.oversubscribes(cpus) and \
            parameters >= MIN_OVERLAP_PARAMETERS

    def oversubscribes(self, cpus: int) -> bool:
        """Whether a prefill thread beside the decode steps on a CPU device would run more
        torch threads than ``cpus``: the prefill's ``--num-threads`` (by default every CPU)
        plus the decode steps' ``--decode-threads`` (by default ``--num-threads``)."""
        threads = self.num_threads or cpus
        return str(self.device) == "cpu" and threads + (self.decode_threads or threads) > cpus

    @property
    def token_budget(self) -> int:
        """Prompt tokens one step prefills: ``max_num_batched_tokens``, else the device
        kind's default (:data:`DEFAULT_BATCHED_TOKENS`)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS[str(self.device).partition(":")[0]]

    @property
    def pass_tokens(self) -> int | None:
        """Tokens one prefill pass of several rows holds at most: ``prefill_pass_tokens``,
        else the device kind's default (:data:`DEFAULT_PASS_TOKENS`; None: no bound)."""
        if self.prefill_pass_tokens is not None:
            return self.prefill_pass_tokens
        return DEFAULT_PASS_TOKENS[str(self.device).partition(":")[0]]

    def __post_init__(self) -> None:
        _check_count("--max-num-seqs", self.max_num_seqs, optional=False, example="8")
        _check_count("--max-num-batched-tokens", self.max_num_batched_tokens, optional=True,
                     example="8192")
        _check_count("--prefill-pass-tokens", self.prefill_pass_tokens, optional=True,
                     example="512")
        _check_count("--num-threads", self.num_threads, optional=True, example="4")
        _check_count("--block-size", self.block_size, optional=False, example="16")
        if self.scheduling not in SCHEDULING:
            raise ConfigError(f"scheduling {self.scheduling!r} is not supported",
                              hint=f"use one of {', '.join(SCHEDULING)}", code="invalid_flag")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy {self.scheduling_policy!r} is not supported",
                              hint=f"use one of {', '.join(SCHEDULING_POLICIES)}",
                              code="invalid_flag")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported",
                              hint=f"use one of {', '.join(DTYPES)}", code="invalid_dtype")
        kind, _, index = str(self.device).partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
            raise ConfigError(f"--device {self.device!r} is not supported",
                              hint="use cpu, cuda or cuda:N", code="invalid_device")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization {self.quantization!r} is not supported",
                              hint=f"use one of {', '.join(QUANTIZATIONS)}, or leave it unset "
                                   "for the weights as loaded", code="invalid_flag")
        if self.quantization is not None and kind != "cpu":
            raise ConfigError(f"--quantization {self.quantization} runs on a CPU device, not "
                              f"{self.device}", hint="pass --device cpu, or leave "
                              "--quantization unset", code="invalid_flag")
        if isinstance(self.reserved_gpu_bytes, bool) or not isinstance(
                self.reserved_gpu_bytes, int) or self.reserved_gpu_bytes < 0:
            raise ConfigError(f"reserved GPU memory must be a byte count of 0 or more, not "
                              f"{self.reserved_gpu_bytes!r}",
                              hint="set it with --mm-ipc-gpu-memory-gb", code="invalid_flag")
        _check_size("--prefix-cache-gb", self.prefix_cache_gb)
        _check_size("--encoder-cache-gb", self.encoder_cache_gb)
        if self.overlap_prefill is not None and not isinstance(self.overlap_prefill, bool):
            raise ConfigError(f"--overlap-prefill must be true, false or unset, not "
                              f"{self.overlap_prefill!r}", code="invalid_flag",
                              hint="pass --overlap-prefill or --no-overlap-prefill")
        _check_count("--decode-threads", self.decode_threads, optional=True, example="1")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"--enable-prefix-caching must be true or false, not "
                              f"{self.enable_prefix_caching!r}",
                              hint="pass --enable-prefix-caching or --no-enable-prefix-caching",
                              code="invalid_flag")

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_gb * (1 << 30))

    @property
    def encoder_cache_bytes(self) -> int:
        return int(self.encoder_cache_gb * (1 << 30))

    @classmethod
    def create(cls, **settings: Any) -> EngineConfig:
        """From keyword settings (``LLM(...)``'s engine arguments): a name that is not a field
        is a :class:`ConfigError` listing the fields."""
        from dataclasses import fields

        names = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ConfigError(f"unknown engine setting{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(unknown)}", hint=f"engine settings: {', '.join(names)}",
                              code="invalid_flag")
        return cls(**settings)


#: Which engine runs the model: this project's ("aphrodite": one process, one device) or
#: vLLM's AsyncLLM in its own environment ("vllm": multi-GPU, multi-node)
EngineKind = Literal["aphrodite", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("aphrodite", "vllm")
DISTRIBUTED_BACKENDS = ("mp", "ray", "uni", "external_launcher")


#: ``--engine vllm`` on a CPU without --kv-cache-memory-bytes: vLLM's KV cache size (its old
#: VLLM_CPU_KVCACHE_SPACE default, 4 GiB), so it starts on a machine where other work runs
VLLM_CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30


@dataclass(frozen=True)
class VllmConfig:
    """vLLM's engine settings for ``serve --engine vllm``, by vLLM's flag names (the shared
    ones, ``--max-num-seqs``, ``--max-model-len``, ``--enable-prefix-caching``, ``--dtype``,
    are :class:`EngineConfig`'s and the server's). ``python``: the interpreter of vLLM's
    environment; None: the project's ``.venv-vllm`` (``make setup-vllm``)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    #: a count, or "auto": this project's engine decides from the model's size and the CPUs
    #: (:func:`engine.cpus.auto_parallel`); vLLM's engine runs one rank. The default stays 1
    #: until a quiet machine confirms the rule (the README's "Engines and threads by default")
    data_parallel_size: int | Literal["auto"] = 1
    distributed_executor_backend: str | None = None
    gpu_memory_utilization: float = 0.9
    #: vLLM's --kv-cache-memory-bytes: its KV cache's size (per GPU; on a CPU, of the
    #: machine's memory); None: vLLM's own rule on a GPU (from gpu_memory_utilization), and on
    #: a CPU :data:`VLLM_CPU_KV_CACHE_DEFAULT_BYTES` (vLLM would want 90% of the memory free)
    kv_cache_memory_bytes: int | None = None
    python: str | None = None

    @property
    def data_parallel_count(self) -> int | None:
        """``data_parallel_size`` as a count; None for "auto" (decided at start)."""
        return None if self.data_parallel_size == "auto" else int(self.data_parallel_size)

    def __post_init__(self) -> None:
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            _check_count(flag, value, optional=False, example="2")
        if self.data_parallel_size != "auto":
            _check_count("--data-parallel-size", self.data_parallel_size, optional=False,
                         example="2 (or auto)")
        if self.distributed_executor_backend is not None and \
                self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ConfigError(f"--distributed-executor-backend "
                              f"{self.distributed_executor_backend!r} is not supported",
                              hint=f"use one of {', '.join(DISTRIBUTED_BACKENDS)} (ray for "
                                   "several nodes)", code="invalid_flag")
        kv = self.kv_cache_memory_bytes
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ConfigError(f"--kv-cache-memory-bytes must be a positive number of bytes, "
                              f"not {kv!r}", hint="e.g. --kv-cache-memory-bytes 4G",
                              code="invalid_flag")
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], not {value!r}",
                              hint="e.g. --gpu-memory-utilization 0.9", code="invalid_flag")
