"""``aphrodite bench mock-server``: a mock endpoint with known delays and capacity."""

from __future__ import annotations

from typing import Annotated

import typer

from aphrodite_cli.output import out

#: ``aphrodite bench mock-server --help``'s epilog.
EXAMPLES = """Example:

  aphrodite bench mock-server --port 9000 --ttft-ms 50 --itl-ms 10"""


def mock_server(
    port: Annotated[int, typer.Option(min=1, max=65535)] = 9000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    ttft_ms: Annotated[float, typer.Option(min=0)] = 0.0,
    itl_ms: Annotated[float, typer.Option(min=0)] = 0.0,
    output_tokens: Annotated[int | None, typer.Option(
        min=1, help="Tokens per answer (default: the request's max_tokens).")] = None,
    headers_ms: Annotated[float, typer.Option(
        min=0, help="When a stream's response headers are sent (at most --ttft-ms); a "
        "client that times TTFT from the headers is caught when this is above 0.")] = 0.0,
    model: Annotated[str, typer.Option(help="The model it serves (GET /v1/models).")
                     ] = "mock",
    require_model: Annotated[bool, typer.Option(
        help="Answer 400, as the OpenAI API does, to a request without --model's name.")
    ] = False,
    max_concurrency: Annotated[int | None, typer.Option(
        min=1, help="Serve at most this many requests at once (the others wait): a known "
                    "capacity of N / (ttft + itl x (tokens - 1)) requests/s.")] = None,
    usage: Annotated[bool, typer.Option(
        help="Send a usage chunk at the end of a stream (--no-usage: like servers that "
             "report none).")] = True,
) -> None:
    """A mock OpenAI-compatible endpoint streaming tokens with a set TTFT and ITL."""
    out.print(f"mock server on http://{host}:{port}/v1 (ttft {ttft_ms} ms, itl {itl_ms} ms)",
              markup=False)
    if not (ttft_ms or itl_ms or headers_ms or max_concurrency):
        # no delay to keep: every answer built once and written in one piece, so the mock
        # costs next to nothing beside the client it measures (load/instant_mock.py)
        from aphrodite_cli.bench.load import instant_mock

        instant_mock.run(host, port, model=model, output_tokens=output_tokens, usage=usage,
                         require_model=require_model)
        return
    from aiohttp import web

    from aphrodite_cli.bench.load.mock_server import create_app

    web.run_app(create_app(ttft_ms, itl_ms, output_tokens, headers_ms, model=model,
                           require_model=require_model, max_concurrency=max_concurrency,
                           usage=usage),
                host=host, port=port, print=None, access_log=None)
