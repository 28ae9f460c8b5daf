"""The flags ``bench serve``, ``sweep`` and ``soak`` share, declared once with their help text:
the target (resolved by :class:`aphrodite_cli.bench.load.target.Target`), the load and its
media, and where and how results go. Each command gives its own default after the ``=``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aphrodite_cli.options import OUTPUT_FORMAT_HELP, MediaDelivery, Mode, OutputFormat

# The target
BaseUrlOpt = Annotated[str | None, typer.Option(
    help="The target: its root as vLLM takes it (http://localhost:8000) or an OpenAI base URL "
         "ending in /v1; requests go to --endpoint under the root.")]
HostOpt = Annotated[str | None, typer.Option(
    help="Target host, with --port, instead of --base-url (vLLM's flags).")]
PortOpt = Annotated[int | None, typer.Option(
    help="Target port (with --host, default 127.0.0.1).")]
EndpointOpt = Annotated[str | None, typer.Option(
    help="Path posted to under the root (default /v1/chat/completions; /v1/completions sends "
         "text prompts).")]
EmbeddedOpt = Annotated[bool, typer.Option(
    help="Start this project's server (tiny default model) for the run.")]
ModelOpt = Annotated[str | None, typer.Option(
    help="Model name to send (and to serve with --embedded); default: the first of the "
         "target's GET /v1/models.")]
ApiKeyOpt = Annotated[str | None, typer.Option(help="Bearer key for the target.")]

# The load and its media
ModeOpt = Annotated[Mode, typer.Option(help="cold, warm or both.")]
NumWarmupsOpt = Annotated[int, typer.Option(
    min=0, help="Unmeasured requests before each measurement (a phase, a sweep's point).")]
BurstinessOpt = Annotated[float, typer.Option(min=0.01, help="Gamma shape; 1 = Poisson.")]
ItemsPerRequestOpt = Annotated[int, typer.Option(min=0, help="Media items per request.")]
BucketConfigOpt = Annotated[str | None, typer.Option(
    metavar="JSON", help='"height,width,frames": probability; frames > 1 is a video.')]
PromptLenOpt = Annotated[int, typer.Option(
    "--prompt-len", "--random-input-len", min=1,
    help="Words of text per prompt (vLLM's --random-input-len counts tokens; a word is about "
         "one token).")]
OutputLenOpt = Annotated[int, typer.Option(
    "--output-len", "--random-output-len", min=1, help="Tokens per answer.")]
MediaDeliveryOpt = Annotated[MediaDelivery, typer.Option(
    help="data-url or http (a built-in loopback media server).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the requests: same seed, same requests.")]
MaxFailureRateOpt = Annotated[float, typer.Option(
    min=0, max=1, help="Exit 1 when more than this share of a measurement's requests (a "
                       "phase, a sweep's point) failed.")]

# The results
OutDirOpt = Annotated[Path, typer.Option(
    "--out-dir", "--result-dir", help="Folder the result file is written to.")]
OutputFormatOpt = Annotated[OutputFormat, typer.Option(help=OUTPUT_FORMAT_HELP)]
