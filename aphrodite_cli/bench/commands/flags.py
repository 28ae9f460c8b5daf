"""The flags ``bench serve``, ``sweep`` and ``soak`` share, declared once with their help text:
the target (resolved by :class:`aphrodite_cli.bench.load.target.Target`), the load and its
media, and where and how results go. A command writes ``base_url: flags.BaseUrl = None``: the
default, after the ``=``, is the command's own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli import options

# The target
BaseUrl = Annotated[str | None, typer.Option(
    help="The target: its root as vLLM takes it (http://localhost:8000) or an OpenAI base URL "
         "ending in /v1; requests go to --endpoint under the root.")]
Host = Annotated[str | None, typer.Option(
    help="Target host, with --port, instead of --base-url (vLLM's flags).")]
Port = Annotated[int | None, typer.Option(
    help="Target port (with --host, default 127.0.0.1).")]
Endpoint = Annotated[str | None, typer.Option(
    help="Path posted to under the root (default /v1/chat/completions; /v1/completions sends "
         "text prompts).")]
Embedded = Annotated[bool, typer.Option(
    help="Start this project's server (tiny default model) for the run.")]
EmbeddedEngine = Annotated[str, typer.Option(
    "--engine", help="With --embedded: the server's engine, aphrodite or vllm (serve --engine "
                     "vllm: vLLM's engine behind this front door; needs .venv-vllm and a "
                     "--model vLLM can run, e.g. one from `aphrodite model make-tiny`).")]
Model = Annotated[str | None, typer.Option(
    help="Model name to send (and to serve with --embedded); default: the first of the "
         "target's GET /v1/models.")]
ApiKey = Annotated[str | None, typer.Option(help="Bearer key for the target.")]
Header = Annotated[list[str] | None, typer.Option(
    "--header", metavar="KEY=VALUE",
    help="A header on every request to the target, GET /v1/models and /metrics included "
         "(repeat for more; vLLM's --header). Names are HTTP tokens, values hold no CR/LF; "
         "Content-Type, Host and (with --api-key) Authorization are the benchmark's own. "
         "Result files keep the names only.")]
ExtraBody = Annotated[str | None, typer.Option(
    metavar="JSON",
    help="A JSON object merged into every request's body (vLLM's --extra-body), e.g. "
         '\'{"chat_template_kwargs": {"enable_thinking": false}}\', mm_processor_kwargs or '
         "cache_salt. A field the benchmark sets itself (model, messages, prompt, max_tokens, "
         "temperature, ignore_eos, stream) is an error naming the flag that sets it.")]
CancellationRate = Annotated[float, typer.Option(
    min=0, max=100,
    help="Percent of each phase's requests the benchmark cancels itself (AIPerf's name), drawn "
         "with --seed: it closes the connection --request-cancellation-delay seconds after "
         "sending. Cancelled requests are counted apart from completed and failed ones, with "
         "no latency sample; one whose answer ended first completes.")]
CancellationDelay = Annotated[float, typer.Option(
    min=0, help="Seconds after sending that a cancelled request's connection is closed (0: at "
                "once, before its answer's headers).")]

# The load and its media
Mode = Annotated[options.Mode, typer.Option(help="cold, warm or both.")]
NumWarmups = Annotated[int, typer.Option(
    min=0, help="Unmeasured requests before each measurement (a phase, a sweep's point).")]
Burstiness = Annotated[float, typer.Option(min=0.01, help="Gamma shape; 1 = Poisson.")]
ItemsPerRequest = Annotated[int, typer.Option(min=0, help="Media items per request.")]
BucketConfig = Annotated[str | None, typer.Option(
    metavar="JSON", help='"height,width,frames": probability; frames > 1 is a video.')]
PromptLen = Annotated[int, typer.Option(
    "--prompt-len", min=1,
    help="Words of text per prompt (about a token each; --random-input-len counts tokens).")]
RandomInputLen = Annotated[int | None, typer.Option(
    min=1, help="Tokens per prompt as the server counts them (usage.prompt_tokens), vLLM's "
                "flag: written with --tokenizer (default: the target's model, the root or id "
                "GET /v1/models names, as a local folder, a cached tiny model or a Hub "
                "id); a chat template's own tokens are "
                "taken off the text. Exact for text-only prompts; media add theirs.")]
RandomRangeRatio = Annotated[float, typer.Option(
    min=0, max=1, help="vLLM's: each prompt's and answer's length drawn uniformly from "
                       "n x (1 - r) to n x (1 + r) (with --random-input-len); below 1.")]
PrefixLen = Annotated[int, typer.Option(
    "--prefix-repetition-prefix-len", min=1,
    help="--dataset-name prefix_repetition (vLLM's): tokens of each shared prefix.")]
SuffixLen = Annotated[int, typer.Option(
    "--prefix-repetition-suffix-len", min=0,
    help="prefix_repetition: tokens of each request's own suffix.")]
NumPrefixes = Annotated[int, typer.Option(
    "--prefix-repetition-num-prefixes", min=1,
    help="prefix_repetition: distinct prefixes; request i has prefix i mod this (shuffled).")]
PrefixOutputLen = Annotated[int, typer.Option(
    "--prefix-repetition-output-len", min=1, help="prefix_repetition: tokens per answer.")]
OutputLen = Annotated[int, typer.Option(
    "--output-len", "--random-output-len", min=1, help="Tokens per answer.")]
MediaDelivery = Annotated[options.MediaDelivery, typer.Option(
    help="data-url or http (a built-in loopback media server).")]
TtftFrom = Annotated[options.TtftFrom, typer.Option(
    help="What a token is in a stream: content (a chunk with text; a server's early role "
         "chunk starts no TTFT) or chunk (any chunk with choices, as vLLM's bench serve "
         "counts: a token whose text is still held, part of a UTF-8 character or a skipped "
         "special token, as random-weight models often give, is timed too).")]
Seed = Annotated[int, typer.Option(help="Seed of the requests: same seed, same requests.")]
MaxFailureRate = Annotated[float, typer.Option(
    min=0, max=1, help="Exit 1 when more than this share of a measurement's requests (a "
                       "phase, a sweep's point) failed.")]

RequestTimeout = Annotated[float, typer.Option(
    min=0.001, help="Seconds one request may take, from send to its answer's last byte; a "
                    "slower one is a request_timeout failure.")]
MaxResponseMb = Annotated[float, typer.Option(
    min=0.001, help="Megabytes one answer may hold; a larger (or endless) one is a "
                    "response_too_large failure.")]

# The results
OutDir = Annotated[Path, typer.Option(
    "--out-dir", "--result-dir", help="Folder the result file is written to.")]
OutputFormat = Annotated[options.OutputFormat, typer.Option(help=options.OUTPUT_FORMAT_HELP)]

# What bench serve watches around each phase (aphrodite_cli/bench/load/observe.py)
AdminApiKey = Annotated[str | None, typer.Option(
    help="Bearer key for the target's cache resets (this project's serve --admin-api-key); "
         "default: --api-key.")]
ResetCaches = Annotated[bool, typer.Option(
    help="Before a cold phase, POST /reset_mm_cache and /reset_prefix_cache (vLLM's routes) "
         "when the target has them; a target without them is said in the output and the "
         "result.")]
ServerCpu = Annotated[bool, typer.Option(
    help="When the target listens on this machine's loopback, read the CPU time each of its "
         "processes spends during each phase (/proc: Linux, processes this user may read): "
         "per request, cores busy, busiest process first (the result's server_cpu).")]
ProbeRequestRate = Annotated[float | None, typer.Option(
    min=0.01, help="Also send small text-only probe requests at this rate (requests/s) during "
                   "each phase, measured apart: their TTFT/E2E show how much the media stall "
                   "other traffic.")]
SliceSeconds = Annotated[float | None, typer.Option(
    min=0.001, help="Per-interval metrics every this-many seconds of a phase (completed, "
                    "req/s, TTFT/TPOT p50/p99, failures), in the result and the report.")]
Archetypes = Annotated[str | None, typer.Option(
    metavar="JSON|FILE",
    help='Named request kinds with weights, e.g. {"photo": {"weight": 3, "buckets": '
         '{"480,640,1": 1}}, "clip": {"weight": 1, "buckets": {"240,320,16": 1}}, "chat": '
         '{"weight": 1, "items": 0}}; every metric is broken down per kind and modality.')]
NumRuns = Annotated[int, typer.Option(
    min=1, max=100, help="Run the phases this many times against the same target; each "
                         "headline metric gets a 95% confidence interval across the runs "
                         "(Student t), which bench gate and report use.")]

# Timed traces (--dataset-name trace, mooncake, timed_trace)
TraceTimeScale = Annotated[float, typer.Option(
    min=0.0001, help="A timed trace's gaps (--dataset-name trace, mooncake) times this: 0.5 "
                     "replays it twice as fast.")]
TimedTraceSecMultiplier = Annotated[float | None, typer.Option(
    min=1e-12, help="vLLM's: seconds per timestamp unit of a mooncake/timed_trace trace "
                    "(0.001 is real time for Mooncake's milliseconds), instead of "
                    "--trace-time-scale.")]
TimedTraceChunk = Annotated[int, typer.Option(
    "--timed-trace-chunk-hash-size", min=1, max=1 << 16,
    help="Tokens per hash id of a mooncake/timed_trace trace (vLLM's flag; 512 here, "
         "Mooncake's block size, where vLLM's default 16 makes Mooncake prompts 32x short).")]
# Public datasets by name (--dataset-name hf / sharegpt; load/hub_datasets.py): vLLM's flags
HfSplit = Annotated[str, typer.Option(
    "--hf-split", help="hf/sharegpt: the split of a Hub dataset (vLLM's flag).")]
HfSubset = Annotated[str | None, typer.Option(
    "--hf-subset", help="hf: the dataset's configuration (subset), e.g. an MMMU subject.")]
HfOutputLen = Annotated[int | None, typer.Option(
    "--hf-output-len", "--sharegpt-output-len", min=1,
    help="hf/sharegpt: tokens per answer (default: --output-len).")]
NoStream = Annotated[bool, typer.Option(
    "--no-stream", help="hf/sharegpt: download the split into the datasets cache "
                        "(HF_HOME) instead of streaming the rows used (vLLM's flag).")]
MetricsInterval = Annotated[float | None, typer.Option(
    "--metrics-interval", min=0.1, max=3600,
    help="Scrape the target's /metrics every this many seconds during each phase (requests "
         "running and waiting, KV and prefix cache, tokens), with GPU utilisation, memory "
         "and NVDEC use through NVML when this machine has a GPU: the result's telemetry, "
         "drawn by bench report.")]
