"""One response's identity and shapes, shared by its JSON and its SSE answer.

A chat request has one prompt; a text completion may have several (``prompt`` as a list):
each is its own engine request of ``n`` rows, and choice ``index`` is ``prompt_index * n +
sample`` as OpenAI numbers them. Usage sums over the prompts. A choice is built in one place
(:meth:`Reply.choice`): a chat ``message`` in a JSON body, a chat ``delta`` in a stream
chunk, ``text`` for a completion either way.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from engine.processing.preprocess import ProcessedPrompt
from engine.server.api.logprobs import ChatLogprobs, CompletionLogprobs
from engine.server.api.protocol import GenerationFields
from engine.server.api.token_counts import mm_token_counts
from engine.server.api.tool_fields import openai_calls
from engine.server.api.tool_parsers import HermesStream, hermes
from engine.server.process.wire import Done
from engine.timings import SERVED_STAGES

if TYPE_CHECKING:
    from engine.server.api.state import State


def finish_reason(reason: str | None) -> str | None:
    """The engine's reason as OpenAI spells it (a cancelled row ended: ``stop``)."""
    return {"abort": "stop"}.get(reason, reason) if reason else None


def ending(reason: str | None, stop_reason: int | str | None, whole: bool) -> dict[str, Any]:
    """A choice's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or stop
    token id that ended it, else null): in every choice of a whole answer, in the stream
    chunk that ends a choice (as vLLM writes them)."""
    out: dict[str, Any] = {"finish_reason": finish_reason(reason)}
    if whole or reason is not None:
        out["stop_reason"] = stop_reason
    return out


class Reply:
    """What the JSON body and the SSE chunks of one request have in common: the id, the
    object names, the choices' shapes and logprobs, usage, and the server-side extension
    (stage timings, cache hits; metrics are observed as each prompt finishes)."""

    def __init__(self, state: State, fields: GenerationFields, prompts: list[ProcessedPrompt],
                 start: float, *, chat: bool, request_id: str | None = None) -> None:
        self.state = state
        self.fields = fields
        self.prompts = prompts
        self.start = start
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.n = fields.sampling.n
        self._logprobs: dict[int, ChatLogprobs | CompletionLogprobs] = {}
        #: per prompt, its tokens the engine's prefix cache supplied
        self._cached_tokens: dict[int, int] = {}
        #: per choice, when its last token arrived (vLLM's inter-token latency)
        self._token_times: dict[int, float] = {}
        #: a forced tool call's text so far, per streamed choice (sent whole at its end)
        self._tool_text: dict[int, str] = {}
        #: tool_choice "auto": each streamed choice's text, content sent as it may go out
        self._hermes: dict[int, HermesStream] = {}

    def at(self, prompt: int, index: int) -> int:
        """The choice index of row ``index`` of prompt ``prompt``."""
        return prompt * self.n + index

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = "text_completion"
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.name, "choices": choices}

    def choice(self, at: int, text: str, reason: str | None, logprobs: Any, *,
               first: bool | None = None, stop_reason: int | str | None = None
               ) -> dict[str, Any]:
        """One choice; ``first`` None: a whole answer (JSON), else a stream chunk's delta
        (a chat delta names the role in the choice's first chunk)."""
        if not self.chat:
            content: dict[str, Any] = {"text": text}
        elif self.fields.tools is not None:
            return self._tool_choice(at, text, reason, logprobs, first, stop_reason)
        elif first is None:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"delta": {"content": text, **({"role": "assistant"} if first else {})}}
        return {"index": at, **content, **ending(reason, stop_reason, first is None),
                "logprobs": logprobs}

    def stream_choice(self, at: int, text: str, reason: str | None, logprobs: Any, *,
                      first: bool, stop_reason: int | str | None = None
                      ) -> dict[str, Any] | None:
        """A stream chunk's choice for one step of choice ``at``; None while a forced tool
        call is under way (its call goes out whole, in the chunk that ends it)."""
        tools = self.fields.tools if self.chat else None
        if tools is not None and tools.parser is not None:
            return self._auto_chunk(at, text, reason, logprobs, first, stop_reason)
        if tools is not None:
            self._tool_text[at] = self._tool_text.get(at, "") + text
            if reason is None:
                return None
            text = self._tool_text.pop(at)
        return self.choice(at, text, reason, logprobs, first=first, stop_reason=stop_reason)

    def _auto_chunk(self, at: int, text: str, reason: str | None, logprobs: Any,
                    first: bool, stop_reason: int | str | None = None
                    ) -> dict[str, Any] | None:
        """tool_choice "auto", streamed: content as it may go out (none once a call
        begins), the calls in the chunk that ends the choice."""
        stream = self._hermes.setdefault(at, HermesStream(
            self.fields.tools.names if self.fields.tools is not None else None))
        content = stream.add(text)
        calls: list[dict[str, Any]] = []
        if reason is not None:
            rest, pairs = stream.finish()
            content += rest
            calls = openai_calls(pairs)
            del self._hermes[at]
        if reason is None and not content:
            return None
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = content or None if calls else content
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            reason = "tool_calls"
        return {"index": at, "delta": delta, **ending(reason, stop_reason, False),
                "logprobs": logprobs}

    def _tool_choice(self, at: int, text: str, reason: str | None, logprobs: Any,
                     first: bool | None, stop_reason: int | str | None = None
                     ) -> dict[str, Any]:
        """A choice of a request with tools: its ``tool_calls`` when it made any
        (finish_reason "tool_calls", or "stop" for a named function, as OpenAI answers), else
        its text as it is (a forced call cut by max_tokens, or "auto" answering in words).
        Under "auto" the calls are read by the server's parser, the text before them is
        the content."""
        tools = self.fields.tools
        content, calls = None, None
        if tools is not None and tools.parser is not None:
            content, pairs = hermes(text, tools.names)
            calls = openai_calls(pairs) if pairs else None
            reason = "tool_calls" if calls else reason
        elif tools is not None and reason == "stop":
            calls = tools.calls(text)
            reason = "tool_calls" if calls is not None and tools.name is None else reason
        message: dict[str, Any] = {"content": text}
        if calls is not None:
            message = {"content": content, "tool_calls": calls if first is None else [
                {"index": k, **c} for k, c in enumerate(calls)]}  # (a delta numbers them)
        key = "message" if first is None else "delta"
        if first is None or first:
            message = {"role": "assistant", **message}
        return {"index": at, key: message, **ending(reason, stop_reason, first is None),
                "logprobs": logprobs}

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens (as the engine counted them, when it tokenizes itself)."""
        return sum(len(p.input_ids) for p in self.prompts)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens the prefix cache supplied (as OpenAI and
        vLLM report them), in the JSON body and the stream's last chunk alike."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())}}

    def tick(self, at: int) -> None:
        """A token of choice ``at`` arrived: the time since its previous one goes to vLLM's
        ``inter_token_latency_seconds``."""
        now = time.perf_counter()
        last = self._token_times.get(at)
        if last is not None:
            self.state.metrics.vllm_itl.labels(self.state.name).observe(now - last)
        self._token_times[at] = now

    def add_logprobs(self, at: int, token_id: int | None, lp: tuple | None
                     ) -> dict[str, Any] | None:
        """Record one token's logprobs for choice ``at``; returns them in a stream chunk's
        shape (None when the request asked for none)."""
        if not self.fields.logprobs or lp is None or token_id is None:
            return None
        return self._choice_logprobs(at).add(token_id, lp)

    def logprobs(self, at: int) -> dict[str, Any] | None:
        """Choice ``at``'s logprobs in a JSON body's shape (None when not asked for)."""
        return self._choice_logprobs(at).body() if self.fields.logprobs else None

    def _choice_logprobs(self, at: int) -> ChatLogprobs | CompletionLogprobs:
        found = self._logprobs.get(at)
        if found is None:
            kind = ChatLogprobs if self.chat else CompletionLogprobs
            found = self._logprobs[at] = kind(self.state.token_strings,
                                              self.fields.tokens_as_ids)
        return found

    def extension(self, prompt: int, done: Done | None) -> dict[str, Any]:
        """The ``aphrodite`` extension after prompt ``prompt`` finished (``done``; None for a
        request that ran nothing), observing its metrics. With several prompts the timings
        are those of the one that finished last (the request's end)."""
        state = self.state
        processed = self.prompts[prompt]
        if done is not None and done.prompt_token_ids is not None:
            # the engine ran its own processor (--engine vllm): its prompt is the real one
            processed.input_ids = list(done.prompt_token_ids)
        timings = {**processed.timings, **(done.timings if done else {}),
                   "server_total_s": round(time.perf_counter() - self.start, 6)}
        if done is not None:
            state.metrics.observe_request(
                state.name, e2e_s=timings["server_total_s"],
                decode_s=float(timings.get("decode_s", 0.0)),
                prompt=len(processed.input_ids),
                generated=sum(len(out.token_ids) for out in done.outputs),
                cached=done.num_cached_tokens, queue_s=done.timings.get("queue_s"))
            self._cached_tokens[prompt] = done.num_cached_tokens
        for name in SERVED_STAGES:
            if name in timings:
                state.metrics.stage.labels(name[:-2]).observe(float(timings[name]))
        return {"timings": timings, "cache_hits": [h for p in self.prompts for h in p.item_hits],
                "mm_tokens": mm_token_counts(state.preprocessor.feature_ids, self.prompts)}
