"""vLLM's ``AsyncLLM`` served over this server's engine wire.

One asyncio loop runs vLLM's engine client; one thread per API server connection reads its
messages and hands them to the loop. A :class:`~engine.server.process.wire.Submit` becomes one
``AsyncLLM.generate`` task: the prompt text (or token ids), the decoded media
(:func:`engine.server.vllm_adapter.vllm_inputs.unpack`) and the request's processor kwargs go to
vLLM's
processor, caches and scheduler; each output step becomes one
:class:`~engine.server.process.wire.Events`, the end a :class:`~engine.server.process.wire.Done`
with the
prompt as vLLM tokenized it. vLLM's refusals (a prompt over the model length, bad kwargs)
come back as this server's 4xx errors; nothing vLLM raises reaches a client as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from engine.server.process import shared_inputs
from engine.server.process.engine_side import accept_api_servers, read_messages
from engine.server.process.outbox import Outbox
from engine.server.process.wire import (
    Delta,
    Done,
    Events,
    Failure,
    Output,
    ResetAnswer,
    ResetMmCache,
    ResetQuery,
    Stats,
    StatsQuery,
    Submit,
)
from engine.server.vllm_adapter import vllm_inputs
from engine.server.vllm_adapter.vllm_inputs import DATA_NEEDED
from engine.server.vllm_adapter.vllm_spec import carve_utilization

logger = logging.getLogger("aphrodite.vllm_bridge")
#: how much of an error message from vLLM a client sees
MAX_MESSAGE = 500
#: times a request vLLM ends with its retryable "error" is submitted again (before any token)
RETRIES = 1


#: vLLM's processor's words for an item named by uuid, without data, that its cache lacks
#: ("Cache miss for image at index 0 but data is not provided.")
CACHE_MISS = "but data is not provided"


class CacheMiss(Exception):
    """vLLM's engine ended a request with a left-out item with its retryable "error"."""


class EngineFailed(Exception):
    """vLLM ended a request with finish reason "error" (a 503: the client may retry)."""


def failure(message: str, status: int, code: str, kind: str = "invalid_request_error"
            ) -> Failure:
    """An OpenAI error body: one line, bounded, no traceback."""
    line = " ".join(str(message).split())[:MAX_MESSAGE] or "the engine refused the request"
    return Failure({"error": {"message": line, "type": kind, "param": None, "code": code}},
                   status)


def sampling_params(sampling: dict[str, Any]) -> Any:
    """This server's sampling fields (``SamplingParams`` of :mod:`engine.executor.sampling`,
    ``max_tokens`` None when the client left it to the model length) as vLLM's, delivered as
    deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    top_k = int(sampling.get("top_k") or 0)
    extra = {}
    spec = sampling.get("structured_outputs")  # a GrammarSpec: (kind, text, param, any_ws)
    if spec is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kind, text, any_whitespace = spec[0], spec[1], spec[3]
        value = json.loads(text) if kind == "choice" else True if kind == "json_object" \
            else text
        extra["structured_outputs"] = StructuredOutputsParams(
            **{kind: value}, disable_any_whitespace=not any_whitespace)
    return SamplingParams(**extra,
        n=int(sampling.get("n", 1)), max_tokens=sampling.get("max_tokens"),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)), top_k=top_k if top_k > 0 else -1,
        seed=sampling.get("seed"), stop=list(sampling.get("stop") or []) or None,
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        logprobs=sampling.get("logprobs"), output_kind=RequestOutputKind.DELTA,
        **{name: sampling[name] for name in _PASSED if name in sampling})


#: the sampling fields vLLM's SamplingParams takes under the same name and meaning
_PASSED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "min_p", "min_tokens", "stop_token_ids", "bad_words", "skip_special_tokens",
           "include_stop_str_in_output")


def vllm_prompt(message: Submit, mm: dict[str, Any]) -> dict[str, Any]:
    """The request as vLLM's raw prompt: text with placeholders and decoded media, or the
    token ids of a text completion."""
    salt = {"cache_salt": message.cache_salt} if message.cache_salt is not None else {}
    if message.prompt is None:
        return {"prompt_token_ids": list(message.input_ids), **salt}
    prompt: dict[str, Any] = {"prompt": message.prompt, **salt}
    data = vllm_inputs.unpack(mm)
    if "image" in data:
        from PIL import Image

        data["image"] = [a if a is None else Image.fromarray(a) for a in data["image"]]
    if data:  # a left-out item (None) needs the list form: vLLM drops a modality of None
        prompt["multi_modal_data"] = {k: v if len(v) > 1 or v[0] is None else v[0]
                                      for k, v in data.items()}
    names = vllm_inputs.uuids(mm)
    if names:
        prompt["multi_modal_uuids"] = names
    if message.mm_processor_kwargs:
        prompt["mm_processor_kwargs"] = dict(message.mm_processor_kwargs)
    return prompt


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (vLLM wraps its processor's ValueError in an
    ``EngineGenerateError``), at most a few deep."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def token_logprobs(token_id: int, entry: Any, top: int) -> tuple | None:
    """vLLM's logprobs of one generated token as the wire's ``(logprob, rank, top_ids,
    top_logprobs)``."""
    if entry is None:
        return None
    items = dict(entry.items()) if hasattr(entry, "items") else {}
    chosen = items.get(token_id)
    ranked = sorted(((lp.rank or 0, tid, lp.logprob) for tid, lp in items.items()
                     if lp.rank is not None), key=lambda r: r[0])[:top]
    return (float(chosen.logprob) if chosen is not None else float("-inf"),
            int(chosen.rank or 0) if chosen is not None else 0,
            [tid for _, tid, _ in ranked], [float(lp) for _, _, lp in ranked])


def stage_timings(metrics: Any, submitted: float) -> dict[str, float]:
    """The engine's stages from vLLM's per-request timestamps (monotonic, as ``submitted``):
    its processor and the hand-over to its engine core, queue, prefill (the encoder
    included), decode."""
    if metrics is None or not getattr(metrics, "queued_ts", 0):
        return {}
    queued, scheduled = metrics.queued_ts, metrics.scheduled_ts or metrics.queued_ts
    first = metrics.first_token_ts or scheduled
    last = metrics.last_token_ts or first
    return {"processor_s": round(max(queued - submitted, 0.0), 6),
            "queue_s": round(max(scheduled - queued, 0.0), 6),
            "prefill_s": round(max(first - scheduled, 0.0), 6),
            "decode_s": round(max(last - first, 0.0), 6)}


class PassSender:
    """What goes back to one API server, from the loop: written by an :class:`Outbox` thread,
    and the token events the loop produces in one pass (every request's output of one vLLM
    step, as vLLM's output handler hands them out) go as one :class:`Events`: one pickle and
    one write per pass, not per request per step. A request's events go before its
    :class:`Done`. Call :meth:`send` on the loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self.loop = loop
        self.outbox = outbox
        self._pending: list[Delta] = []

    def send(self, message: Any) -> None:
        if isinstance(message, Events):
            if not self._pending:
                self.loop.call_soon(self.flush)
            self._pending.extend(message.deltas)
            return
        self.flush()
        self.outbox.put(message)

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.outbox.put(Events(batch))


class Bridge:
    """The requests of every API server, on vLLM's engine."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm = llm
        self.loop = loop
        self.tasks: dict[str, asyncio.Task] = {}
        self.senders: list[Any] = []

    async def run(self, message: Submit, send) -> None:
        rid = message.rid
        try:
            mm = shared_inputs.attach(message.mm)
        except (OSError, ValueError) as exc:
            logger.error("request %s: its inputs could not be mapped: %s", rid, exc)
            send(Done(rid, [], {}, failure("the request's inputs were lost on the way to the "
                                           "engine", 503, "inputs_lost", "internal_error")))
            return
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        #: per row: its finish_reason and vLLM's stop_reason, once it ended
        reasons: dict[int, tuple[str, int | str | None]] = {}
        submitted = time.monotonic()
        top = int(message.sampling.get("logprobs") or 0)
        prompt_ids: list[int] | None = None
        cached, metrics = 0, None
        try:
            prompt = vllm_prompt(message, mm)
            params = sampling_params(message.sampling)
            kwargs = {"tokenization_kwargs": {"add_special_tokens": False}} \
                if message.prompt is not None else {}
            for attempt in range(1 + RETRIES):
                generation = self.llm.generate(prompt, params, rid if not attempt else
                                               f"{rid}.retry{attempt}",
                                               priority=message.priority, **kwargs)
                try:
                    async for out in generation:
                        if any(c.finish_reason == "error" for c in out.outputs):
                            # vLLM's retryable failure (its processor cache and its engine's
                            # disagreed; the items go again with their data): again, if the
                            # client has seen nothing yet; with items left out the data is
                            # the API server's to send (DATA_NEEDED below)
                            if vllm_inputs.left_out(message.mm) and not any(ids.values()):
                                raise CacheMiss("vLLM's engine no longer holds a left-out "
                                                "item")
                            if attempt < RETRIES and not any(ids.values()):
                                logger.warning("request %s: vLLM asked for a retry", rid)
                                break
                            raise EngineFailed("vLLM's engine failed the request; retry it")
                        deltas = self.deltas(rid, out, texts, ids, reasons, params, top)
                        if deltas:
                            send(Events(deltas))
                        if out.prompt_token_ids is not None:
                            prompt_ids = list(out.prompt_token_ids)
                        cached = out.num_cached_tokens or cached
                        metrics = out.metrics or metrics
                    else:
                        break  # it ran to its end
                finally:
                    await generation.aclose()
        except asyncio.CancelledError:
            return  # cancelled by the API server: it expects nothing more
        except Exception as exc:
            why = next((e for e in causes(exc) if isinstance(e, CacheMiss) or (
                isinstance(e, ValueError) and CACHE_MISS in str(e))), None)
            if why is not None and not any(ids.values()) and vllm_inputs.left_out(message.mm):
                # vLLM's processor cache no longer holds an item the API server left out
                # (engine.server.vllm_adapter.vllm_media): it sends the data, once
                logger.info("request %s: vLLM lacks a left-out item (%s)", rid, why)
                send(Done(rid, [], {}, failure(str(why), 503, DATA_NEEDED, "internal_error")))
                return
            send(Done(rid, [], {}, self.refusal(rid, exc)))
            return
        outputs = [Output(i, "".join(texts[i]), ids.get(i, []), *reasons.get(i, (None, None)))
                   for i in sorted(texts)]
        send(Done(rid, outputs, stage_timings(metrics, submitted), None, cached, prompt_ids))

    @staticmethod
    def deltas(rid: str, out: Any, texts: dict[int, list[str]], ids: dict[int, list[int]],
               reasons: dict[int, tuple[str, int | str | None]], params: Any, top: int
               ) -> list[Delta]:
        """One vLLM output step (deltas of each row) as the wire's events, one per token (the
        step's text on its last token), recorded for the request's :class:`Output` s."""
        events: list[Delta] = []
        for c in out.outputs:
            new = list(c.token_ids)
            lps = list(c.logprobs or []) if c.logprobs is not None else []
            texts.setdefault(c.index, []).append(c.text)
            ids.setdefault(c.index, []).extend(new)
            stop = getattr(c, "stop_reason", None) if c.finish_reason is not None else None
            if c.finish_reason is not None:
                reasons[c.index] = (c.finish_reason, stop)
            for k, tid in enumerate(new):
                last = k == len(new) - 1
                lp = token_logprobs(tid, lps[k] if k < len(lps) else None, top) \
                    if params.logprobs is not None else None
                events.append(Delta(rid, c.index, tid, c.text if last else "",
                                    c.finish_reason if last else None, lp,
                                    stop if last else None))
            if not new and (c.text or c.finish_reason):
                events.append(Delta(rid, c.index, None, c.text, c.finish_reason, None, stop))
        return events

    @staticmethod
    def refusal(rid: str, exc: BaseException) -> Failure:
        """vLLM's exception as this server's error: the request's fault is a 400, an engine
        that died a 503, anything else a 500 (logged here with its traceback)."""
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, GracefulHTTPError):
            status = int(exc.http_status)
            return failure(exc.message, status, "engine_refused",
                           "invalid_request_error" if status < 500 else "overloaded_error")
        if isinstance(exc, EngineDeadError):
            return failure("vLLM's engine stopped", 503, "engine_dead", "internal_error")
        if isinstance(exc, EngineFailed):
            return failure(str(exc), 503, "engine_error", "internal_error")
        # vLLM wraps its processor's refusal of the request's kwargs or media in an
        # EngineGenerateError: the cause is the client's
        cause = next((e for e in causes(exc)[1:] if isinstance(e, ValueError | TypeError)),
                     None)
        if cause is not None:
            logger.info("request %s refused by vLLM's processor: %s", rid, cause)
            return failure(str(cause), 400, "invalid_request")
        if isinstance(exc, VLLMClientError | ValueError | TypeError | KeyError):
            logger.info("request %s refused by vLLM: %s", rid, exc)
            return failure(str(exc), 400, "invalid_request")
        logger.exception("request %s failed in vLLM", rid, exc_info=exc)
        return failure("internal error in the vLLM engine", 500, "internal_error",
                       "internal_error")

    async def reset(self, what: str) -> dict[str, Any]:
        if what == "mm":
            await self.llm.reset_mm_cache()
            for send in list(self.senders):
                send(ResetMmCache())
            return {"reset": True, "api_servers": len(self.senders)}
        if what == "prefix":
            answer = await self.llm.reset_prefix_cache()
            return {"reset": answer is not False}
        return {"reset": False, "note": f"unknown cache {what!r}"}

    def stats(self) -> dict[str, float]:
        rss = 0
        with contextlib.suppress(OSError, ValueError, IndexError), \
                open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"rss_bytes": rss, "requests_in_flight": len(self.tasks)}

    def serve_connection(self, conn: Connection) -> None:
        """One API server's messages (in its own thread) onto the loop, until it leaves.

        Answers go through a :class:`PassSender`: the loop also runs vLLM's output handler
        (detokenizing), and a loop that wrote to the socket per output fell behind the engine
        under load; vLLM then merged each request's steps into one output, and its tokens
        reached the client in one burst at the end (TPOT ~0, TTFT the whole answer)."""
        mine: set[str] = set()
        sender = PassSender(self.loop, Outbox(conn))
        send = sender.send
        self.senders.append(send)

        bridge = self

        class OnTheLoop:  # engine_side.Handlers, each called on the loop
            @staticmethod
            def submit(message: Submit) -> None:
                task = bridge.loop.create_task(bridge.run(message, send))
                bridge.tasks[message.rid] = task
                mine.add(message.rid)
                task.add_done_callback(lambda _t, rid=message.rid: (
                    bridge.tasks.pop(rid, None), mine.discard(rid)))

            @staticmethod
            def cancel(rid: str) -> None:
                task = bridge.tasks.get(rid)
                if task is not None:
                    task.cancel()

            @staticmethod
            def stats(message: StatsQuery) -> None:
                send(Stats(message.rid, bridge.stats()))

            @staticmethod
            def reset(message: ResetQuery) -> None:
                async def answer(q: ResetQuery = message) -> None:
                    send(ResetAnswer(q.rid, await bridge.reset(q.what)))
                bridge.loop.create_task(answer())

            @staticmethod
            def leave() -> None:
                for rid in list(mine):
                    task = bridge.tasks.get(rid)
                    if task is not None:
                        task.cancel()
                with contextlib.suppress(ValueError):
                    bridge.senders.remove(send)
                sender.outbox.close(timeout=0.0)  # nobody reads what is left

        read_messages(conn, OnTheLoop, self.loop.call_soon_threadsafe)


def _exit_with_parent() -> None:
    """Linux: this process gets SIGTERM when the supervisor dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def serve(spec: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dict(spec["engine_args"])
    if isinstance(args.get("structured_outputs_config"), dict):
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(
            **args["structured_outputs_config"])
    reserved = int(spec.get("reserved_gpu_bytes") or 0)
    if reserved:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            args["gpu_memory_utilization"] = carve_utilization(
                args.get("gpu_memory_utilization", 0.9), reserved, total)
            logger.info("--mm-ipc-gpu-memory-gb: vLLM's gpu_memory_utilization %.3f",
                        args["gpu_memory_utilization"])
    if args.get("kv_cache_memory_bytes") is None and spec.get("cpu_kv_cache_bytes"):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # (else vLLM wants 90% of the memory free at start;
            # VLLM_CPU_KVCACHE_SPACE, when set, still wins: vLLM's own rule)
            args["kv_cache_memory_bytes"] = int(spec["cpu_kv_cache_bytes"])
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    loop = asyncio.get_running_loop()
    bridge = Bridge(llm, loop)
    listener = Listener(spec["address"], authkey=bytes.fromhex(spec["authkey"]))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        os.write(spec["ready_fd"], f"{os.getpid()}\n".encode())
        os.close(spec["ready_fd"])
        threads = await loop.run_in_executor(None, accept_api_servers, listener,
                                             int(spec["api_servers"]), bridge.serve_connection)
        everyone_left = loop.run_in_executor(None, lambda: [t.join() for t in threads])
        await asyncio.wait([everyone_left, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        with contextlib.suppress(OSError):
            listener.close()
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(spec["address"]))
        for task in list(bridge.tasks.values()):
            task.cancel()
        llm.shutdown()
        # once: AsyncLLM's __del__ would shut it down again at the interpreter's exit, when
        # vLLM's module globals are already gone (a traceback on every stop)
        llm.shutdown = _stopped


def _stopped(timeout: float | None = None) -> None:
    """An AsyncLLM's shutdown once it has shut down."""


def run(main_coroutine: Any) -> None:
    """The bridge's loop: uvloop's where vLLM's environment has it (vLLM's own server runs
    on it; the loop carries vLLM's output handler and this bridge's messages), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
    else:
        uvloop.run(main_coroutine)


def main() -> int:
    """Read the settings line, serve until every API server left (or SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    spec = json.loads(sys.stdin.readline())
    try:
        run(serve(spec))
    except Exception as exc:  # start-up failure: one line, the supervisor reports the exit
        logger.error("vLLM's engine could not start: %s", exc)
        return 1
    return 0
