"""One model per result ``kind``: its schema version and the fields its readers (the gate, the
report, the soak's baseline) rely on, with their types.

Result files are written and read as JSON documents; these models validate a document before
it is written (a writer cannot produce a file its readers refuse) and when it is loaded (a file
cut short, edited or written by something else is refused by field, not misread or met with a
KeyError half-way through a report). Every model allows fields it does not name: a new field
needs no new version; a field that changes meaning or goes away bumps the kind's ``VERSION``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: one per-request sample (a latency, a rate, a size): a finite number, at least 0, never a
#: boolean or a string taken as one (a NaN gated as PASS, a negative latency as a speed-up)
Sample = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
#: a phase's samples: metric -> values, or a group (the server's stages) of them
Samples = dict[str, list[Sample] | dict[str, list[Sample]]]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Stats(_Open):
    """A metric's summary (count, mean, median, p50, p90, p99...); the ones a reader prints."""

    median: Annotated[float, Field(allow_inf_nan=False)] | None = None
    p99: Annotated[float, Field(allow_inf_nan=False)] | None = None


class _Result(_Open):
    KIND: ClassVar[str]
    VERSION: ClassVar[int]
    schema_version: int
    kind: str
    environment: dict[str, Any] = {}
    created_utc: str | None = None


# --- bench serve ------------------------------------------------------------------------------
class ServeCache(_Open):
    hit_rate: float | None = None


class ServePrefixCache(_Open):
    """The target's prefix cache in a phase: prompt tokens it supplied (``usage.
    prompt_tokens_details.cached_tokens``) of those it reported; ``hit_rate`` None when it
    reported none (absent in results written before it was measured)."""

    cached_tokens: int = 0
    prompt_tokens: int = 0
    hit_rate: float | None = None


class ServeTurn(_Open):
    """One turn index of a phase of multi-turn sessions (load/turn_metrics.py)."""

    turn: int
    requests: int = 0
    completed: int = 0
    ttft_ms: dict[str, float | None] = {}
    prompt_tokens: dict[str, float | None] = {}
    output_tokens: dict[str, float | None] = {}
    prefix_hit_rate: float | None = None


class ServePerTurn(_Open):
    """A phase of multi-turn sessions by turn index, and the server's run-wide prefix cache
    hit rate (``/metrics``; None without its counters)."""

    turns: list[ServeTurn]
    prefix_cache_server: float | None = None


class TelemetryMetrics(_Open):
    """The target's /metrics over a phase: one ``{"t_s": ..., series: value}`` per scrape."""

    available: bool
    reason: str | None = None
    samples: list[dict[str, float]] = []

    @model_validator(mode="after")
    def _timed(self) -> TelemetryMetrics:
        if any("t_s" not in s for s in self.samples):
            raise ValueError("every telemetry sample has its time, t_s")
        return self


class TelemetryGpuTick(_Open):
    t_s: float
    gpus: list[dict[str, float | int | None]]


class TelemetryGpu(_Open):
    """This machine's GPUs over a phase (NVML): ``{"t_s", "gpus": [per GPU]}`` per tick."""

    available: bool
    reason: str | None = None
    samples: list[TelemetryGpuTick] = []


class ServeTelemetry(_Open):
    """``--metrics-interval``: the phase's time series (absent without the flag)."""

    interval_s: float
    metrics: TelemetryMetrics
    gpu: TelemetryGpu


class ServePhase(_Open):
    """One phase (cold, warm): the per-request samples the gate pools, and the summary the
    report prints (absent in a hand-made file: the report prints "-")."""

    samples: Samples
    completed: int | None = None
    failed: int | None = None
    request_throughput: float | None = None
    cancelled: int | None = None  # requests the run cancelled itself (absent before)
    # None when the target reported no usage (prompt tokens unknown), absent in older files
    total_input_tokens: int | None = None
    input_token_throughput: float | None = None
    total_token_throughput: float | None = None
    ttft_ms: Stats = Stats()
    tpot_ms: Stats = Stats()
    e2e_ms: Stats = Stats()
    ttst_ms: Stats = Stats()  # time to second token
    output_token_throughput_per_user: Stats = Stats()  # tokens/s, 1 / TPOT per request
    server_cache: ServeCache = ServeCache()
    prefix_cache: ServePrefixCache = ServePrefixCache()
    per_turn: ServePerTurn | None = None  # multi-turn sessions only (absent otherwise)
    telemetry: ServeTelemetry | None = None


class ServeResult(_Result):
    """``bench serve``: per phase (cold, warm) the client's per-request samples and summary."""

    KIND = "serve"
    VERSION = 2  # 2: server stages in ms named *_ms (were *_s); version 1 is read, upgraded
    phases: dict[str, ServePhase]
    config: dict[str, Any] = {}
    target: dict[str, Any] = {}


# --- bench mm-processor -----------------------------------------------------------------------
class ProcessorPhase(_Open):
    samples: Samples
    total_s: Stats = Stats()
    hit_rate: float | None = None


class VideoBackendRow(_Open):
    backend: str
    clip: str
    decode_ms: Stats


class ProcessorResult(_Result):
    """``bench mm-processor``: per phase the preprocessing stages per request, and the video
    decode time per backend on the same clips."""

    KIND = "mm-processor"
    VERSION = 1
    phases: dict[str, ProcessorPhase]
    video_backends: list[VideoBackendRow] = []


class ProcessorCompareResult(_Result):
    """``bench mm-processor --compare-models``: one entry per model on the same media."""

    KIND = "mm-processor-compare"
    VERSION = 1
    results: list[dict[str, Any]]


# --- bench sweep ------------------------------------------------------------------------------
class Capacity(_Open):
    rate: float | None = None
    limited_by: str | None = None


class PointLatency(_Open):
    """A sweep point's measurement: the latency summaries the report plots (and more)."""

    ttft_ms: Stats = Stats()
    tpot_ms: Stats = Stats()
    e2e_ms: Stats = Stats()


class SweepPoint(_Open):
    kind: str
    offered_rate: float | None = None
    served_rate: float | None = None
    result: PointLatency


class SweepPhase(_Open):
    points: list[SweepPoint]
    capacity: Capacity | None = None
    seconds: float | None = None


class SweepResult(_Result):
    """``bench sweep``: per phase the measured load points and the capacity under the SLOs."""

    KIND = "sweep"
    VERSION = 2  # 2: stages named *_ms; capacity a sustained rate; version 1 is read, upgraded
    phases: dict[str, SweepPhase]
    slos: list[str] = []


class SweepServePhase(_Open):
    total_token_throughput: float | None = None
    output_token_throughput_per_user: float | None = None
    pareto: bool = False


class SweepServeRun(_Open):
    """One combination of ``bench sweep serve``: its parameter sets and its result's file."""

    serve_index: int
    bench_index: int
    serve_params: dict[str, Any]
    bench_params: dict[str, Any]
    result: str
    phases: dict[str, SweepServePhase]


class SweepServeResult(_Result):
    """``bench sweep serve``: one row per server x bench parameter combination, and per phase
    the Pareto front (output tokens/s per user against total tokens/s)."""

    KIND = "sweep-serve"
    VERSION = 1
    runs: list[SweepServeRun]
    pareto: dict[str, list[int]] = {}


# --- bench batching ---------------------------------------------------------------------------
class Seconds(_Open):
    median: float


class Scheduling(_Open):
    """One scheduling policy's figures in a mixed-workload batching result."""

    output_throughput: Stats
    request_throughput: Stats
    short_ttft_s: Stats = Stats()


class BatchingResult(_Result):
    """``workload`` uniform: N requests together vs one after another; mixed: static vs
    continuous scheduling side by side (each a dict of its figures)."""

    KIND = "batching"
    VERSION = 1
    workload: Literal["uniform", "mixed"] = "uniform"
    concurrency: int | None = None
    concurrent_s: Seconds | None = None
    sequential_s: Seconds | None = None
    speedup_median: float | None = None
    static: Scheduling | None = None
    continuous: Scheduling | None = None
    continuous_over_static_output_throughput: float | None = None

    @model_validator(mode="after")
    def _workload_fields(self) -> BatchingResult:
        needed = (("concurrency", "concurrent_s", "sequential_s", "speedup_median")
                  if self.workload == "uniform" else
                  ("static", "continuous", "continuous_over_static_output_throughput"))
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.workload} batching result needs {', '.join(missing)}")
        return self


# --- bench decode-step ------------------------------------------------------------------------
class ReadBandwidth(_Open):
    gb_s: Stats


class DecodeStepRow(_Open):
    """One batch size and context length: the step's time, the bytes it must read and its
    ratio to the floor (bytes over the read bandwidth)."""

    batch_size: int
    context_len: int
    step_ms: Stats
    weight_bytes: int
    kv_bytes: int
    bytes: int
    floor_ms: float
    ratio_to_floor: float
    #: "none" (the weights as loaded) or the --quantization method
    quantization: str = "none"
    #: a quantized row's step over the same configuration's unquantized one
    vs_unquantized: float | None = None
    #: --compile-decode: whether the compiled step ran (None: not compared)
    compiled: bool | None = None
    #: a compiled row's step over the same configuration's eager one
    vs_eager: float | None = None


class QuantQuality(_Open):
    """A quantized model against the same model's weights as loaded, on a fixed prompt set."""

    prompts: int
    tokens_per_prompt: int
    positions: int
    top1_agreement: float
    mean_kl: float
    greedy_match: float
    identical_prompts: int


class DecodeStepResult(_Result):
    """``bench decode-step``: the engine's decode step per configuration beside the
    machine's read bandwidth measured in the same run (``--quantization``: ``quality`` per
    method)."""

    KIND = "decode-step"
    VERSION = 1
    num_threads: int
    bandwidth: ReadBandwidth
    rows: list[DecodeStepRow]
    quality: dict[str, QuantQuality] = {}
    #: --compile-decode: the wait for the compiles (s), the buckets compiled, an error, and
    #: the graphs compiled during the timed steps (0 unless a compiled bucket was guarded out)
    compile: dict[str, Any] | None = None


# --- bench video-decode -----------------------------------------------------------------------
class Reference(_Open):
    median_s: float | None = None


class Clip(_Open):
    width: int
    height: int
    codec: str | None = None
    frames: int | None = None


class BackendRow(_Open):
    backend: str
    options: dict[str, Any] = {}
    median_s: float | None = None
    ratio_to_full_decode: float | None = None
    identical_to_exact: Any = None


class VideoDecodeResult(_Result):
    """``bench video-decode``: each backend's sampled decode against a full ffmpeg decode."""

    KIND = "video-decode"
    VERSION = 1
    reference: Reference
    backends: list[BackendRow]
    clip: Clip
    num_frames: int


# --- bench soak -------------------------------------------------------------------------------
class SoakResult(_Result):
    """``bench soak``: valid requests' latency under attack, and the resources over time."""

    KIND = "soak"
    VERSION = 3  # 3: valid latency, attackers
    valid_latency_s: Stats


MODELS: dict[str, type[_Result]] = {m.KIND: m for m in (
    ServeResult, SweepResult, SweepServeResult, ProcessorResult, ProcessorCompareResult,
    BatchingResult, DecodeStepResult, VideoDecodeResult, SoakResult)}
