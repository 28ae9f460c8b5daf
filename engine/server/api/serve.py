"""One API server process: load the tokenizer and processor, connect to the engine
processes, serve the app on the supervisor's listening socket until SIGTERM/SIGINT, then drain
(see :mod:`engine.server.launcher`, which starts it)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path
from typing import Any

from engine.server.config import ServerConfig

#: seconds an API server finishes its in-flight requests after SIGTERM/SIGINT
DRAIN_S = 30.0


def api_server_main(config: ServerConfig, model_path: str, name: str, addresses: list[str],
                    authkey: bytes, ready: Any, sock: socket.socket,
                    metrics_dir: str | None = None, engines_up: Any = None) -> None:
    """Entry point of one API server process: serves on the supervisor's listening socket
    and sets ``ready`` once it accepts connections; ``addresses``: the engine processes'
    sockets (several: ``--data-parallel-size``), connected once ``engines_up`` (an event:
    the API servers load while the engines start) is set. With ``metrics_dir`` (several API
    servers) its metrics go to that shared folder, which prometheus_client reads from the
    environment when it is first imported: set here, before anything imports it."""
    for variable in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        os.environ.pop(variable, None)  # one inherited from the environment is not ours
    if metrics_dir is not None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import values

    # prometheus_client picks its value class when first imported; a wrapper script may
    # have imported it before this ran (spawn re-imports the parent's main module). Only a
    # wrong one is replaced: two multiprocess classes would each map the same file.
    if (metrics_dir is not None) == (values.ValueClass is values.MutexValue):
        values.ValueClass = values.get_value_class()
    import asyncio

    from engine.lifetime import exit_sooner, exit_with_parent, name_process
    from engine.memory import tune_allocator
    from engine.models.loader import load_model
    from engine.server.api.app import create_app
    from engine.server.process.engine_client import EngineClient

    name_process("api")
    exit_with_parent()
    tune_allocator()
    import torch

    from engine import envs

    torch.set_num_threads(envs.APHRODITE_API_SERVER_TORCH_THREADS)
    loaded = load_model(model_path, chat_template=config.chat_template, served_name=name)
    if engines_up is not None:
        engines_up.wait()
    clients = [EngineClient(address, authkey) for address in addresses]
    engine: Any = clients[0]
    if len(clients) > 1:  # data-parallel engines: each request to one of them
        from engine.server.process.engine_pool import EnginePool

        engine = EnginePool(clients)
    try:
        asyncio.run(_serve_app(create_app(config, loaded, engine), sock, ready, config))
    finally:
        engine.close()
        if metrics_dir is not None:
            _leave_metrics_dir(metrics_dir)
        for folder in {os.path.dirname(address) for address in addresses}:
            # the server's private folder, once its engines removed their sockets: the last
            # process out removes it (also when the supervisor was killed outright)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        exit_sooner()



def _leave_metrics_dir(path: str) -> None:
    """This API server's metric files go with it; the last one out removes the folder (also
    when the supervisor was killed outright and cannot)."""
    for file in Path(path).glob(f"*_{os.getpid()}.db"):
        file.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)


async def _serve_app(app: Any, sock: socket.socket, ready: Any, config: ServerConfig
                     ) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then stop accepting and drain (up to DRAIN_S).
    Connections are limited first (engine.server.api.connections): keep-alive and header-read
    timeouts, a per-client and a total cap, accept errors logged once."""
    import asyncio

    from aiohttp import web

    from engine.server.api.connections import (
        AcceptErrorLog,
        ConnectionGuard,
        raise_open_file_limit,
        total_connection_cap,
    )

    asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=DRAIN_S,
                           keepalive_timeout=config.keep_alive_timeout_s)
    await runner.setup()
    ConnectionGuard(per_client=config.max_connections_per_client,
                    total=total_connection_cap(raise_open_file_limit()),
                    header_timeout_s=config.header_read_timeout_s).install(runner.server)
    try:
        await web.SockSite(runner, sock).start()
        ready.set()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
