"""``aphrodite serve``'s supervisor: validate everything, start one engine process and N API
server processes on one listening socket, supervise them (an API server process itself:
:mod:`engine.server.api.serve`).

The supervisor binds the port itself, first (a port in use is a one-line error and exit 1
before anything loads), and hands that one socket to every API server process, as gunicorn,
uvicorn and vLLM do: no other process can join the port, as SO_REUSEPORT would let a second
server on the same port silently take half the traffic.

SIGTERM/SIGINT drains: API servers stop accepting, finish in-flight requests (up to
``DRAIN_S``), then the engine stops. A child that dies on its own is reported by name and exit
code, and the others are stopped: nothing is left hanging, the exit status is 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, StartupError
from engine.models.generation_config import bad_file, describe, sampling_defaults
from engine.server.api.serve import DRAIN_S, api_server_main
from engine.server.config import ServerConfig
from engine.server.engines import engines_for
from engine.server.fork_server import fork_server, started_all

logger = logging.getLogger("aphrodite.server")


def validate(config: ServerConfig) -> tuple[Any, str]:
    """Every startup check, before any child starts (the flag checks again: this also
    runs on its own, in a throwaway process)."""
    from engine.media.video.gpu import check_gpu_backend_startup
    from engine.models.loader import load_model
    from engine.processing.pipeline import Pipeline

    check_flags(config)
    from engine.server.api.connections import raise_open_file_limit

    raise_open_file_limit()  # the API servers inherit it
    engines_for(config).check_device(config)
    loaded = load_model(config.model, chat_template=config.chat_template,
                        served_name=config.served_model_name, revision=config.revision,
                        download_dir=config.download_dir)
    if not loaded.chat_template:
        raise ConfigError(
            f"the model {loaded.name} has no chat template, so /v1/chat/completions cannot "
            "format messages", hint="pass --chat-template FILE (for LLaVA-1.5: "
            "engine/models/templates/llava.jinja)", code="chat_template_missing")
    # the API servers' pipeline, built as they build it: limits, processor kwargs, video
    # options and media policy checked against this model
    pipeline = Pipeline(loaded, config.pipeline)
    check_gpu_backend_startup(pipeline.video, config.mm_ipc_gpu_memory_gb)
    return loaded, loaded.name


def _validated_model(config: ServerConfig) -> tuple[str, str]:
    loaded, name = validate(config)
    return str(loaded.path), name


def validate_in_child(config: ServerConfig, ctx: Any) -> tuple[str, str]:
    """:func:`validate` in a throwaway process of ``ctx`` (the fork server's): (model folder,
    served name). The supervisor then never imports torch or transformers, and stays small
    (~50 MB instead of ~700 MB); errors come back as themselves. A supervisor stopped while
    the check runs stops the check (it would otherwise keep the fork server alive), and a
    supervisor killed outright takes it along (:func:`engine.lifetime.exit_with_parent`)."""
    receive, send = ctx.Pipe(duplex=False)
    check = ctx.Process(target=_check_and_send, args=(config, send), name="start-up check")
    check.start()
    send.close()
    try:
        try:
            passed, value = receive.recv()
        except EOFError:  # it died without an answer
            check.join(5)
            raise StartupError(f"the start-up check exited (code {check.exitcode})",
                               hint="see the messages above") from None
    finally:
        if check.exitcode is None:
            check.terminate()
        check.join(10)
        if check.exitcode is None:
            check.kill()
            check.join()
        receive.close()
    if not passed:
        raise value
    return value


def _check_and_send(config: ServerConfig, send: Any) -> None:
    from engine.lifetime import exit_with_parent

    exit_with_parent()
    try:
        answer: tuple[bool, Any] = (True, _validated_model(config))
    except Exception as err:  # (a refusal: it is raised again in the supervisor)
        answer = (False, err)
    try:
        send.send(answer)
    except Exception as err:  # an error that does not pickle: its words do
        send.send((False, StartupError(f"the start-up check failed: {answer[1]!r} ({err})")))


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's one listening socket (no SO_REUSEPORT: a busy port is an error)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc.strerror})",
                          hint="use an address such as 127.0.0.1, 0.0.0.0 or ::") from None
    family = infos[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is already in use",
                               hint="stop the process that holds it, or choose another --port",
                               code="port_in_use") from None
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}",
                           hint="choose another --host/--port (ports below 1024 need root)",
                           code="port_unavailable") from None


def _wait_ready(host: str, port: int, procs: list[Any], events: list[Any],
                timeout: float) -> None:
    """Wait until every API server listens (each sets its event once its socket accepts)
    and the port answers /health; a child that exits meanwhile is a startup failure."""
    deadline = time.monotonic() + timeout
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.exitcode is not None:
                raise StartupError(f"{proc.name} exited during startup (code {proc.exitcode})",
                                   hint="see the messages above")
        if not all(event.wait(0.1) for event in events):
            continue
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    waiting = [p.name for p, e in zip(procs[1:], events, strict=False) if not e.is_set()]
    raise StartupError(f"the server did not become ready within {timeout:.0f} s"
                       + (f" ({', '.join(waiting)} not listening)" if waiting else ""))


def publish_processes(path: str, roles: dict[str, Any]) -> None:
    """``--process-file``: the pids by role as JSON, replaced whole (a reader never sees
    half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(roles, f)
    os.replace(tmp, path)


def _join_all(procs: list[Any], timeout: float) -> None:
    """Wait for every one of ``procs`` to exit, ``timeout`` seconds for them all."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def check_flags(config: ServerConfig) -> None:
    """The checks that need no model (and no torch): a bad flag is reported as such (exit 2)
    before the port is bound, whatever holds the port. (The media policy and video options
    were checked when the flags became ``config.pipeline``; each field's own bounds and
    choices when the config was built.)"""
    engines_for(config).check_flags(config)


def checked_defaults(mode: str, model_path: str) -> dict[str, Any]:
    """``--generation-config``'s request defaults for the model, each checked as a request's
    value would be (a model's file with a temperature this server refuses stops the start,
    rather than failing every request that leaves it out)."""
    from engine.errors import InvalidRequestError
    from engine.executor.sampling import MAX_TOKENS_CAP, SamplingParams

    defaults = sampling_defaults(mode, model_path)
    try:  # (a larger max_new_tokens is the room's bound, as the server's cap is)
        SamplingParams(**{**defaults, "max_tokens": min(defaults.get("max_tokens", 1),
                                                        MAX_TOKENS_CAP)})
    except (InvalidRequestError, TypeError) as err:
        raise bad_file(Path(mode if mode != "auto" else model_path) / "generation_config.json",
                       str(err)) from None
    return defaults


def run(config: ServerConfig, *, announce=print) -> int:
    """Check the flags, bind, start, supervise and stop the server processes; returns the
    exit status."""
    check_flags(config)
    sock = bind_listener(config.host, config.port)
    try:
        return _run(config, sock, announce)
    finally:
        sock.close()


def _run(config: ServerConfig, sock: socket.socket, announce) -> int:
    from engine.lifetime import name_process

    name_process("supervisor")
    folder = Path(tempfile.mkdtemp(prefix="aphrodite-"))
    try:
        with _stop_interrupts_startup(), fork_server(folder) as ctx:
            return _supervise(config, sock, announce, ctx, folder)
    except _StopRequested as stop:
        announce(f"stopped during start-up ({signal.Signals(stop.signum).name})")
        return 0
    finally:  # (also when the start-up check failed: nothing else removes it then)
        shutil.rmtree(folder, ignore_errors=True)


class _StopRequested(BaseException):
    """SIGTERM or SIGINT while the server starts (a BaseException, as KeyboardInterrupt is:
    no ``except Exception`` of a start-up step takes it for a failure of its own)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_interrupts_startup():
    """Until the supervisor's drain handler takes over (once the children have started):
    SIGTERM or SIGINT stops the start-up where it is, and the ``finally`` blocks on the way
    out stop what has started and remove the server's files; the default (as a plain
    process, SIGTERM would end it at once, leaving the fork server, the start-up check, their
    temp folder and named semaphores behind). A second signal ends the process at once."""
    def stop(signum: int, _frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        raise _StopRequested(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(config: ServerConfig, sock: socket.socket, announce, ctx: Any,
               folder: Path) -> int:
    model_path, name = validate_in_child(config, ctx)
    defaults = checked_defaults(config.generation_config, model_path)
    if defaults:  # once, as vLLM does
        announce(describe(defaults, config.generation_config))
        config = dataclasses.replace(config, sampling_defaults=defaults)
    backend = engines_for(config)
    config = backend.fit(config, model_path, announce)
    authkey = secrets.token_bytes(32)
    started = backend.start(config, ctx, model_path, name, folder, authkey)
    grace_s = backend.stop_grace_s
    engines = [engine for engine, _, _, _ in started]
    addresses = [address for _, _, address, _ in started]
    stopping = {"flag": False}

    def stop(*_: Any) -> None:
        stopping["flag"] = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    apis: list[Any] = []
    metrics_dir: str | None = None
    try:
        listening = [ctx.Event() for _ in range(config.api_server_count)]
        # Several API servers share their counters through files here (see server.metrics),
        # so a scrape sees the server's totals, not one process's share.
        if config.api_server_count > 1:
            metrics_dir = tempfile.mkdtemp(prefix="aphrodite-metrics-")
        # The API servers start beside the engines (their imports and the model's processor
        # load while the engines load the model: a start-up of the tiny model 17 -> 12 s)
        # and connect once ``engines_up`` says every engine listens.
        engines_up = ctx.Event()
        for i, event in enumerate(listening):
            proc = ctx.Process(target=api_server_main, name=f"API server {i}", args=(
                config, model_path, name, addresses, authkey, event, sock, metrics_dir,
                engines_up))
            proc.start()
            apis.append(proc)
        settings = []  # each engine's (pid, thread settings: None for vLLM's)
        for engine, ready, _, _ in started:
            while not ready.poll(0.2):
                for proc in engines:
                    if proc.exitcode is not None:
                        raise getattr(proc, "refusal", None) or StartupError(
                            f"the {proc.name} exited during startup (code {proc.exitcode})",
                            hint="see the messages above")
                for proc in apis:
                    if proc.exitcode is not None:
                        raise StartupError(f"{proc.name} exited during startup (code "
                                           f"{proc.exitcode})", hint="see the messages above")
                if stopping["flag"]:
                    return 0
            try:
                settings.append(ready.recv())
            except EOFError:  # it closed its end by exiting: poll saw the end, not a message
                engine.join(5)
                raise getattr(engine, "refusal", None) or StartupError(
                    f"the {engine.name} exited during startup (code {engine.exitcode})",
                    hint="see the messages above") from None
        engines_up.set()
        _wait_ready(config.host, config.port, [*engines, *apis], listening, timeout=180)
        started_all(folder)
        # Every API server listens on its own copy now. Without this one, the port would
        # keep taking connections into a backlog nobody accepts once they start draining.
        sock.close()
        for (engine, _, _, cpus), (_, threads) in zip(started, settings, strict=True):
            if threads:  # (before the ready line, which tools wait for)
                pinned = f" (CPUs {','.join(map(str, cpus))})" if cpus else ""
                announce(f"{engine.name.replace(' process', '')}{pinned}: {threads}")
        pids = ", ".join(str(pid) for pid, _ in settings)
        if config.process_file:  # before the ready line: whoever waits for it reads this
            publish_processes(config.process_file, {
                "supervisor": os.getpid(), "engines": [pid for pid, _ in settings],
                "api_servers": [p.pid for p in apis]})
        announce(f"aphrodite serving {name} on http://{config.host}:{config.port} "
                 f"({config.api_server_count} API server(s); supervisor pid {os.getpid()}, "
                 f"engine pid{'s' if len(settings) > 1 else ''} {pids}, API server pids "
                 f"{', '.join(str(p.pid) for p in apis)})")
        while not stopping["flag"]:
            for proc in [*engines, *apis]:
                if proc.exitcode is not None:
                    announce(f"error: the {proc.name} exited unexpectedly (code "
                             f"{proc.exitcode}); stopping the server")
                    return 1
            time.sleep(0.2)
        announce("draining in-flight requests and stopping")
        return 0
    finally:
        for proc in apis:
            if proc.exitcode is None:
                proc.terminate()  # SIGTERM: aiohttp stops accepting and drains
        for proc in apis:
            proc.join(DRAIN_S + 5)
            if proc.exitcode is None:
                proc.kill()
        # The engines exit once their API servers are gone: all of them within one wait,
        # then the ones left are stopped together (vLLM stops its workers: it gets longer).
        _join_all(engines, 10)
        for engine in engines:
            if engine.exitcode is None:
                engine.terminate()
        _join_all(engines, grace_s)
        for engine in engines:
            if engine.exitcode is None:
                engine.kill()
        _join_all(engines, 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for _, ready, _, _ in started:
            if hasattr(ready, "fd"):  # the vLLM engine's ready pipe
                with contextlib.suppress(OSError):
                    ready.close()
        if config.process_file:
            with contextlib.suppress(OSError):
                os.unlink(config.process_file)
        shutil.rmtree(folder, ignore_errors=True)  # the engine removes it itself when it can
        if metrics_dir is not None:  # so do the API servers (the last one out)
            shutil.rmtree(metrics_dir, ignore_errors=True)
        sys.stdout.flush()
