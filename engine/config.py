"""Typed configuration objects. The CLI builds these from flags; the core sees nothing else."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from engine import envs
from engine.cpus import ONE_THREAD_PARAMETERS
from engine.errors import ConfigError
from engine.settings import check, setting

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


def _env(name: str) -> Any:
    """A field whose default is the ``APHRODITE_*`` variable ``name``'s (declared once, in
    :mod:`engine.envs`); ``from_env`` reads the variable itself."""
    return field(default=envs.default(name), metadata={"env": name})


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from: the operator's allow-lists. Their flags' help is on the
    fields: every command that fetches media (``serve``, ``media probe``, ``media decode``)
    shows it (``aphrodite_cli/options.py``).

    ``allowed_domains``: exact host names (after :func:`normalize_host`). When non-empty only
    these hosts are fetched; a listed host may also resolve to private addresses. When empty
    any host on a public address is fetched.
    ``allowed_local_path``: the only folder ``file://`` URLs may read; ``None`` refuses them.
    """

    allowed_domains: frozenset[str] = setting(
        frozenset(), flag="--allowed-media-domains", metavar="HOST",
        help="Only fetch media from these exact hosts (repeat the flag or separate with "
             "commas). A listed host may resolve to private addresses; unlisted hosts on "
             "private addresses are always refused.")
    allowed_local_path: Path | None = setting(
        None, flag="--allowed-local-media-path", metavar="DIR",
        help="Folder that file:// media URLs may read from (no symlinks followed). Without "
             "it file:// URLs are refused.")
    max_redirects: int = _env("APHRODITE_MEDIA_MAX_REDIRECTS")

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

    #: the ``APHRODITE_*`` variables of a modality's caps, by field (``{M}``: its name)
    ENV: ClassVar[dict[str, str]] = {"max_bytes": "APHRODITE_MAX_{M}_BYTES",
                                     "fetch_timeout_s": "APHRODITE_{M}_FETCH_TIMEOUT"}

    @classmethod
    def of(cls, modality: Modality, read: Callable[[str], Any] = envs.default
           ) -> ModalityLimits:
        """``modality``'s caps from its variables (declared once, in :mod:`engine.envs`):
        their defaults, or with ``read=envs.get`` their values."""
        return cls(**{name: read(env.format(M=modality.upper()))
                      for name, env in cls.ENV.items()})


@dataclass(frozen=True)
class MediaLimits:
    """Byte, time, pixel and duration caps for media, per modality. Every default is an
    ``APHRODITE_*`` variable's (:mod:`engine.envs`); :meth:`from_env` reads their values."""

    #: each modality's caps: by default its variables' defaults (``ModalityLimits.of``)
    image: ModalityLimits = field(default_factory=partial(ModalityLimits.of, "image"),
                                  metadata={"modality": "image"})
    video: ModalityLimits = field(default_factory=partial(ModalityLimits.of, "video"),
                                  metadata={"modality": "video"})
    audio: ModalityLimits = field(default_factory=partial(ModalityLimits.of, "audio"),
                                  metadata={"modality": "audio"})
    max_image_pixels: int = _env("APHRODITE_MAX_IMAGE_PIXELS")
    max_audio_seconds: float = _env("APHRODITE_MAX_AUDIO_SECONDS")
    max_video_frame_pixels: int = _env("APHRODITE_MAX_VIDEO_FRAME_PIXELS")
    max_video_frames: int = _env("APHRODITE_MAX_VIDEO_FRAMES")
    max_video_decoded_bytes: int = _env("APHRODITE_MAX_VIDEO_DECODED_BYTES")
    fetch_retries: int = _env("APHRODITE_MEDIA_FETCH_RETRIES")
    max_jpeg_scan_pixels: int = _env("APHRODITE_MAX_JPEG_SCAN_PIXELS")
    max_audio_decode_samples: int = _env("APHRODITE_MAX_AUDIO_DECODE_SAMPLES")
    image_background: tuple[int, int, int] = _env("APHRODITE_IMAGE_BACKGROUND")

    def for_modality(self, modality: Modality) -> ModalityLimits:
        return getattr(self, modality)

    @classmethod
    def from_env(cls, **overrides: object) -> MediaLimits:
        """Defaults from the ``APHRODITE_*`` variables; keyword overrides win."""
        limits = cls(**{f.name: ModalityLimits.of(f.metadata["modality"], envs.get)
                        if "modality" in f.metadata else envs.get(f.metadata["env"])
                        for f in fields(cls) if {"modality", "env"} & set(f.metadata)})
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
    limit_mm_per_prompt: dict[str, int] | None = setting(
        None, metavar="JSON", help='Items per prompt, e.g. \'{"image": 4, "video": 1}\'.')
    mm_processor_kwargs: dict[str, Any] | None = setting(
        None, metavar="JSON", help='Processor settings, e.g. \'{"max_pixels": 802816}\'.')
    mm_processor_cache_gb: float = setting(
        4.0, ge=0, example="4",
        help="Processor cache size per API server in GB (0 disables), e.g. 4; with "
             "--engine vllm, vLLM's processor cache (its flag).")
    #: encoded media kept per client media ``uuid`` (engine.processing.media_uuids), in GB
    mm_uuid_cache_gb: float = setting(
        1.0, ge=0, example="1",
        help="Media kept per client media uuid, per API server, in GB (0: none), e.g. "
             "1: a content part may then send its uuid alone (\"image_url\": null) to "
             "reuse media it sent before with that uuid.")
    request_kwargs: RequestKwargs = "any"
    #: rescale + normalize pixels on the model's device where the family allows (vLLM's
    #: --mm-device-do-normalize, on by default as there)
    mm_device_do_normalize: bool = setting(
        True, help="Rescale and normalize pixels on the model's device, not in the API server "
                   "(vLLM's flag; Qwen2/2.5/3-VL): a quarter of the bytes through the cache "
                   "and to the engine.")

    PANEL: ClassVar[str] = "Media and processing"

    def __post_init__(self) -> None:
        check(self)


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
#: ``--device``'s forms: the CPU, the first GPU, or GPU N (N a whole number)
DEVICES = ("cpu", "cuda", "cuda:N")
#: ``--quantization`` methods (vLLM's flag): "int8" packs the language model's linear weights
#: at load as int8 rows with a scale each, dequantized in the product (weight-only; a CPU
#: device); unset: the weights as loaded
QUANTIZATIONS = ("int8",)


#: ``max_num_batched_tokens`` when none is given, per device kind: vLLM's defaults for its
#: OpenAI server (2048 on a CPU; 8192 on a GPU, where vLLM also uses 2048 below 70 GiB). A
#: burst of requests is then prefilled a budget's worth per step, first come first served,
#: while the rows already running decode between steps: the first requests get their first
#: token sooner than if every waiting prompt were prefilled in one pass (measured with the
#: small Qwen2.5-VL at concurrency 8, cold: TTFT p50 1991 ms instead of 3551 ms, the same
#: requests/s).
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


#: ``long_prefill_token_threshold`` when none is given, per device kind. On a CPU a prefill
#: stops every running row for as long as it takes: on the 43 M-parameter Qwen2.5-VL (2
#: threads) a 3985-token prompt, in the default budget's 2048-token chunks, held the running
#: rows' next token 1.3-2.3 s; in chunks of 512 at most 0.44-0.62 s, for 1.2x the time to
#: its own first token (scripts/prefill_gap.py; docs/performance.md). On a GPU such a
#: prefill takes tens of milliseconds, and vLLM's default is off: 0.
DEFAULT_LONG_PREFILL_TOKENS = {"cpu": 512, "cuda": 0}


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
    ``long_prefill_token_threshold``: while rows are decoding, a joining prompt with more
    tokens than this to prefill is prefilled in chunks of at most this many, the running rows
    decoding between them (vLLM's flag); 0: off; ``None``:
    :data:`DEFAULT_LONG_PREFILL_TOKENS` per device kind, or 0 where the engine prefills
    beside its decode steps (see :attr:`long_prefill_tokens`).
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
    ``compile_decode``: the lean decode step's work between attentions compiled by
    ``torch.compile`` per batch-size bucket (:mod:`engine.models.lean_compile`).
    """

    PANEL: ClassVar[str] = "Engine"

    max_num_seqs: int = setting(
        8, ge=1, example="8",
        help="Sequences in the running batch (a request's n counts n), e.g. 8: between "
             "decode steps finished ones leave and waiting ones join.")
    max_num_batched_tokens: int | None = setting(
        None, ge=1, example="8192",
        help="Prompt tokens prefilled in one step when requests join the running "
             "batch, e.g. 8192 (a longer prompt is prefilled alone, a chunk per step); "
             f"default: vLLM's, {DEFAULT_BATCHED_TOKENS['cpu']} on a CPU and "
             f"{DEFAULT_BATCHED_TOKENS['cuda']} on a GPU.")
    long_prefill_token_threshold: int | None = setting(
        None, ge=0, example="512",
        help="While requests are decoding, a joining prompt with more than this many tokens "
             "to prefill (after the prefix cache) is prefilled in chunks of at most this "
             "many, the running requests taking a decode step between chunks instead of "
             "waiting for the whole prefill (vLLM's flag), e.g. 512; with nothing running "
             "it is prefilled whole, up to --max-num-batched-tokens. 0 turns it off. "
             f"Default: {DEFAULT_LONG_PREFILL_TOKENS['cpu']} on a CPU (0 with "
             "--overlap-prefill in effect: the prefill already runs beside the decode "
             f"steps), {DEFAULT_LONG_PREFILL_TOKENS['cuda']} (off) on a GPU.")
    prefill_pass_tokens: int | None = setting(
        None, ge=1, example="512",
        help="Most tokens (padding included) one prefill forward pass of several requests "
             "holds, e.g. 512; a step's requests beyond it go in further passes, and each "
             f"pass sends its first tokens as it ends. Default: {DEFAULT_PASS_TOKENS['cpu']} "
             "on a CPU (a pass that size already runs at full speed), no bound on a GPU.")
    scheduling: Scheduling = setting("continuous", choices=SCHEDULING, flag="scheduling",
                                     cli=False, help="How rows join a running batch.")
    scheduling_policy: SchedulingPolicy = setting(
        "fcfs", choices=SCHEDULING_POLICIES,
        help="Which waiting requests join the running batch first (vLLM's flag): fcfs, the "
             "oldest; priority, the lowest request 'priority' field (vLLM's; other values "
             "are refused under fcfs), then the oldest; shortest (ours), the fewest prompt "
             "tokens left to prefill after the prefix cache, so a video prompt does not hold "
             "up the image and text prompts that came after it. Under each a request "
             f"passed over {MAX_OVERTAKES} times goes first (priority's bound on waiting), "
             "and the sequences of one request (prompts x n) take turns with other "
             "requests'.")
    device: str = setting("cpu", metavar=f"<{'|'.join(DEVICES)}>",  # (a choice's look)
                          help="cpu, cuda (the first GPU) or cuda:N (GPU N).")
    dtype: str = setting("auto", choices=DTYPES, code="invalid_dtype",
                         help="The weights' type; auto: the checkpoint's own (its config's "
                              "torch_dtype).")
    num_threads: int | None = setting(
        None, ge=1, example="4",
        help="torch threads of the engine process, e.g. 1 to match vLLM's CPU worker, "
             "which pins one core; default: the CPUs the process may use (its affinity and "
             "cgroup quota; torch's own default counts every core) over --data-parallel-size; "
             f"1 with --data-parallel-size auto on a model below "
             f"{ONE_THREAD_PARAMETERS // 1_000_000} M parameters. API servers use "
             "APHRODITE_API_SERVER_TORCH_THREADS.")
    decode_threads: int | None = setting(
        None, ge=1, example="1",
        help="torch threads of the decode steps, e.g. 1 (llama.cpp's --threads beside "
             "--threads-batch); prefills and encoders keep --num-threads. A decode step "
             "multiplies a few rows by every weight, bound by reading them: where a second "
             "thread adds no memory bandwidth it only adds waiting (scripts/dp_auto_bench.sh "
             "SETTINGS='auto d1' compares the two on your machine). Beside --overlap-prefill "
             "a prefill keeps --num-threads. Default: --num-threads.")
    reserved_gpu_bytes: int = setting(0, ge=0, flag="--mm-ipc-gpu-memory-gb", cli=False,
                                      example="4", help="GPU memory left to others, in bytes.")
    enable_prefix_caching: bool = setting(
        True, help="Keep the keys and values of prompts' leading blocks (text, and media by "
                   "their content) and reuse them for later prompts that start the same way "
                   "(vLLM's flag and default).")
    prefix_cache_gb: float = setting(
        0.5, ge=0, le=1 << 20, example="0.5 (0 turns the cache off)",
        help="Prefix cache size in GB, on the model's device, e.g. 4.")
    encoder_cache_gb: float = setting(
        0.25, ge=0, le=1 << 20, example="0.5 (0 turns the cache off)",
        help="Encoder output cache size in GB (0 disables), on the model's device: a media "
             "item seen before skips the encoder when its prefix misses, e.g. 1.")
    block_size: int = setting(
        16, ge=1, example="16",
        help="Tokens per prefix-cache block (vLLM's flag): prompts share cached keys and "
             "values a whole block at a time, e.g. 16.")
    overlap_prefill: bool | None = setting(
        None, help="Prefill the requests that join on a second thread while the running ones "
                   "keep decoding (a CPU's matrix products run beside each other on two "
                   "cores); default: on a CPU when --num-threads plus --decode-threads is at "
                   "most the CPUs the process may use.")
    quantization: str | None = setting(
        None, choices=QUANTIZATIONS, aliases=("-q",),
        help="int8: the language model's linear weights as int8 rows with a scale each "
             "(weight-only, packed at load; a CPU device): a quarter of float32's weight "
             "bytes per decode step, whose products widen them to float32 in registers "
             "(the engine's linear kernel; a prefill multiplies by a bfloat16 copy). Its "
             "speed and quality cost (greedy agreement, KL against float32): aphrodite "
             "bench decode-step --quantization int8. Default: off.")
    compile_decode: bool = setting(
        False,
        help="Compile the decode step's work between attentions with torch.compile "
             "(inductor; needs a C++ compiler), a graph per batch-size bucket (1, 2, 4, 8, "
             "... up to --max-num-seqs; a step's rows padded up to the next, as vLLM's CUDA "
             "graphs), compiled on a background thread at start-up: until a bucket is ready "
             "the eager step runs it, and a failed compile leaves it eager. Logits within "
             "float rounding of the eager step's, not its bits: a row's may change with its "
             "batch's bucket and once the bucket is compiled (the eager step keeps a row's "
             "bits whatever its batch-mates). Off by default: on the tiny and 43 M "
             "models a step took 0.95-1.00x the eager one's at batch 1 and 8 (one thread), "
             "for 1-2 minutes of compiling on the cores at start-up (docs/performance.md; "
             "aphrodite bench decode-step --compile-decode compares both).")

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
    def long_prefill_tokens(self) -> int:
        """The most prompt tokens a prefill may take in one step while rows are decoding
        (0: no bound but the budget): ``long_prefill_token_threshold``, else the device
        kind's default (:data:`DEFAULT_LONG_PREFILL_TOKENS`). The engine sets it to 0 where
        it prefills beside its decode steps and none was given."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return DEFAULT_LONG_PREFILL_TOKENS[str(self.device).partition(":")[0]]

    @property
    def pass_tokens(self) -> int | None:
        """Tokens one prefill pass of several rows holds at most: ``prefill_pass_tokens``,
        else the device kind's default (:data:`DEFAULT_PASS_TOKENS`; None: no bound)."""
        if self.prefill_pass_tokens is not None:
            return self.prefill_pass_tokens
        return DEFAULT_PASS_TOKENS[str(self.device).partition(":")[0]]

    def __post_init__(self) -> None:
        check(self)  # each field's bounds and choices, declared on it
        kind, _, index = str(self.device).partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
            raise ConfigError(f"--device {self.device!r} is not supported",
                              hint=f"use {', '.join(DEVICES[:-1])} or {DEVICES[-1]}",
                              code="invalid_device")
        if self.quantization is not None and kind != "cpu":
            raise ConfigError(f"--quantization {self.quantization} runs on a CPU device, not "
                              f"{self.device}", hint="pass --device cpu, or leave "
                              "--quantization unset", code="invalid_flag")

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


#: requests in flight the engine holding a key's prefix may have over the least busy one and
#: still be chosen (engine/server/process/engine_pool.py; with 2, a warm phase at
#: concurrency 8 over 2 engines found 66-75% of its prompt tokens cached, against 98% on
#: one engine: each diverted request prefilled anew)
BALANCE_SLACK = 4


def _m(parameters: int) -> str:
    """A parameter count as help writes it: 10 M."""
    return f"{parameters // 1_000_000} M"


@dataclass(frozen=True)
class ParallelConfig:
    """How many copies of the model run and how each is split, for both engines (vLLM's
    ``ParallelConfig`` names): this project's engine runs ``data_parallel_size`` processes on
    one machine's CPUs and refuses model splits; vLLM's takes them all."""

    PANEL: ClassVar[str] = "Parallelism"

    tensor_parallel_size: int = setting(
        1, ge=1, example="2", help="--engine vllm: GPUs each model replica is split across, "
                                   "e.g. 8.")
    pipeline_parallel_size: int = setting(
        1, ge=1, example="2", help="--engine vllm: pipeline stages (across nodes with Ray), "
                                   "e.g. 2.")
    #: a count, or "auto" (the default): this project's engine decides from the model's size
    #: and the CPUs (:func:`engine.cpus.auto_parallel`; measured in docs/performance.md,
    #: "Engines and threads by default"); vLLM's engine runs one rank
    data_parallel_size: int | Literal["auto"] = setting(
        "auto", metavar="N|auto",
        help="Model replicas, e.g. 2, or auto (the default): this project's engine decides "
             f"from the model's parameters and the CPUs: below {_m(ONE_THREAD_PARAMETERS)} "
             "one engine on one thread, larger one engine on every CPU (measured in "
             "docs/performance.md, 'Engines and threads by "
             "default'); --num-threads, if given, stays. A count: that many engine processes "
             "on this machine's CPUs, each with its own copy of the model and its own caches "
             "(N times the memory), each pinned to its own share of them with an even share "
             "of --num-threads by default; each request goes to one: where its first image "
             "(or its prompt's start) went before, while that one is at most "
             f"{BALANCE_SLACK} requests busier than another (each engine's prefix and "
             "encoder caches are its own), else the least busy. --engine vllm: vLLM's data "
             "parallel ranks.")
    distributed_executor_backend: str | None = setting(
        None, choices=DISTRIBUTED_BACKENDS,
        help="--engine vllm: mp (one node) or ray (several nodes); default: vLLM's choice.")

    @property
    def data_parallel_count(self) -> int | None:
        """``data_parallel_size`` as a count; None for "auto" (decided at start)."""
        return None if self.data_parallel_size == "auto" else int(self.data_parallel_size)

    def __post_init__(self) -> None:
        check(self)
        value = self.data_parallel_size
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
            raise ConfigError(f"--data-parallel-size must be a whole number of at least 1 or "
                              f"auto, not {value!r}", hint="e.g. --data-parallel-size 2 "
                              "(or auto)", code="invalid_flag")


@dataclass(frozen=True)
class VllmConfig:
    """vLLM's own engine settings for ``serve --engine vllm``, by vLLM's flag names (the
    shared ones are :class:`EngineConfig`'s, :class:`ParallelConfig`'s and the server's)."""

    PANEL: ClassVar[str] = "vLLM engine (--engine vllm)"

    gpu_memory_utilization: float = setting(
        0.9, gt=0, le=1, example="0.9",
        help="--engine vllm: fraction of each GPU vLLM plans for, e.g. 0.9; "
             "--mm-ipc-gpu-memory-gb comes out of it (out of the KV cache).")
    #: vLLM's --kv-cache-memory-bytes: its KV cache's size (per GPU; on a CPU, of the
    #: machine's memory); None: vLLM's own rule on a GPU (from gpu_memory_utilization), and on
    #: a CPU :data:`VLLM_CPU_KV_CACHE_DEFAULT_BYTES` (vLLM would want 90% of the memory free)
    kv_cache_memory_bytes: int | None = setting(
        None, ge=1, example="4G", metavar="SIZE",
        help="--engine vllm: vLLM's KV cache size (its flag; per GPU, or of the memory on a "
             "CPU), e.g. 4G (GiB) or 4g (GB). Default: from --gpu-memory-utilization on a "
             f"GPU; {VLLM_CPU_KV_CACHE_DEFAULT_BYTES >> 30}G on a CPU, where vLLM would "
             "otherwise want 90% of the memory free to start (VLLM_CPU_KVCACHE_SPACE, when "
             "set, wins over both).")
    #: vLLM's --enforce-eager: no torch.compile of the model at start-up (CUDA graphs on a
    #: GPU); measured on 2 CPU cores, the tiny Qwen2.5-VL: 30 of an 80 s start-up compiling
    enforce_eager: bool = setting(
        False, help="--engine vllm: vLLM's --enforce-eager: run the model eagerly, without "
                    "compiling it at start-up (torch.compile; CUDA graphs on a GPU): a "
                    "shorter start-up, slower steps. This project's engine is eager unless "
                    "--compile-decode.")
    #: the interpreter of vLLM's environment; None: the project's ``.venv-vllm``
    python: str | None = setting(
        None, flag="--vllm-python",
        help="--engine vllm: the Python of vLLM's environment; default .venv-vllm/bin/python.")

    def __post_init__(self) -> None:
        check(self)
