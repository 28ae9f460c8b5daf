"""``aphrodite bench ...``: wiring only. The commands are plain functions in ``commands/``, one
module per group; this is the one place they are registered, in the order ``--help`` lists
them."""

from __future__ import annotations

import typer

from aphrodite_cli.bench.commands import (
    mock_server,
    offline,
    results,
    serve,
    soak,
    sweep,
    sweep_serve,
)

app = typer.Typer(help="Benchmarks that write result files.", no_args_is_help=True)

app.command("video-decode", epilog=offline.VIDEO_DECODE_EXAMPLES)(offline.video_decode)
app.command("mm-processor", epilog=offline.MM_PROCESSOR_EXAMPLES)(offline.mm_processor)
app.command("batching")(offline.batching)
app.command("decode-step", epilog=offline.DECODE_STEP_EXAMPLES)(offline.decode_step)
# extra arguments: vLLM's `--goodput ttft:500 tpot:50` (several values after one flag)
app.command("serve", epilog=serve.EXAMPLES,
            context_settings={"allow_extra_args": True})(serve.serve_cmd)
# `bench sweep` measures load points itself; `bench sweep serve` (a subcommand) sweeps server
# flags: a group that runs its own callback when no subcommand follows
sweep_app = typer.Typer(invoke_without_command=True, no_args_is_help=False)
sweep_app.callback(epilog=sweep.EXAMPLES)(sweep.sweep_cmd)
sweep_app.command("serve", epilog=sweep_serve.EXAMPLES)(sweep_serve.sweep_serve_cmd)
app.add_typer(sweep_app, name="sweep")
app.command("soak", epilog=soak.EXAMPLES)(soak.soak)
app.command("gate", epilog=results.GATE_EXAMPLES)(results.gate)
app.command("report", epilog=results.REPORT_EXAMPLES)(results.report)
app.command("mock-server", epilog=mock_server.EXAMPLES)(mock_server.mock_server)

__all__ = ["app"]
