"""The transformers runner: one batched ``generate`` call for several requests.

Requests in a batch are left-padded and their media tensors concatenated in order. Each row
keeps its own sampling parameters: generation runs greedy, and a logits processor samples
each row's token with that row's temperature/top-k/top-p/seed and forces it. A stopping
criterion ends rows individually (max_tokens, EOS, stop strings, cancellation); a streamer
hands every new token to its request as it is produced. Hooks on the vision/audio encoder
time it, so prefill, encoder, first token and decode are reported separately.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from engine.executor.request import CompletionOutput, EngineRequest, TokenEvent
from engine.models.loader import LoadedModel


@dataclass
class _Row:
    request: EngineRequest
    index: int
    generator: Any
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    first_token_at: float | None = None


class TransformersRunner:
    """Runs batches of :class:`EngineRequest` on a Hugging Face model."""

    def __init__(self, loaded: LoadedModel, device: str = "cpu", dtype: str = "auto") -> None:
        self.loaded = loaded
        self.device = device
        self.model = loaded.model(device, dtype)
        self.tokenizer = loaded.tokenizer
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else next(iter(self.eos_ids), 0)
        self._encoder_s = 0.0
        self._hook_encoder()

    def _hook_encoder(self) -> None:
        attr = self.loaded.spec.encoder_attr
        module = getattr(self.model, attr, None) or getattr(getattr(self.model, "model", None),
                                                            attr, None)
        if module is None:
            return
        starts: list[float] = []
        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def after(*_: Any) -> None:
            if starts:
                self._encoder_s += time.perf_counter() - starts.pop()

        module.register_forward_hook(after)

    def _inputs(self, rows: list[_Row]) -> dict[str, Any]:
        import torch

        seqs = [r.request.prompt.input_ids for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
        inputs: dict[str, Any] = {"input_ids": ids.to(self.device),
                                  "attention_mask": mask.to(self.device)}
        merged: dict[str, list[Any]] = {}
        for r in rows:
            for key, value in r.request.prompt.mm.items():
                if key != "mm_token_type_ids":
                    merged.setdefault(key, []).append(value)
        for key, values in merged.items():
            inputs[key] = torch.cat(values, dim=0).to(self.device)
        if any("mm_token_type_ids" in r.request.prompt.mm for r in rows):
            types = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                row_types = r.request.prompt.mm.get("mm_token_type_ids")
                if row_types is not None:
                    types[i, width - row_types.shape[1]:] = row_types[0]
            inputs["mm_token_type_ids"] = types.to(self.device)
        return inputs

    def run(self, requests: list[EngineRequest]) -> None:
        """Generate for every request (each expanded to ``n`` rows); fills their outputs."""
        import torch
        from transformers import LogitsProcessorList

        rows: list[_Row] = []
        for req in requests:
            req.outputs = [CompletionOutput(i) for i in range(req.params.n)]
            for i in range(req.params.n):
                gen = None
                if req.params.seed is not None:
                    gen = torch.Generator(device="cpu").manual_seed(req.params.seed + i)
                rows.append(_Row(req, i, gen))
        started = time.perf_counter()
        self._encoder_s = 0.0
        sampler, stop, streamer = _hooks()
        inputs = self._inputs(rows)
        max_new = max(r.request.params.max_tokens for r in rows)
        # On an exception no row is finished: the engine decides per request whether it can
        # be run again (nothing sent yet) or has failed (see Engine._isolate).
        with torch.inference_mode():
            self.model.generate(
                **inputs, max_new_tokens=max_new, do_sample=False,
                logits_processor=LogitsProcessorList([sampler(rows)]),
                stopping_criteria=[stop(rows)], streamer=streamer(self, rows),
                pad_token_id=self.pad_id,
                eos_token_id=None, use_cache=True)
        finished = time.perf_counter()
        for row in rows:
            if not row.done:
                self._finish(row, "abort" if row.request.cancelled.is_set() else "length")
        first = min((r.first_token_at for r in rows if r.first_token_at), default=finished)
        for req in requests:
            firsts = [r.first_token_at for r in rows if r.request is req and r.first_token_at]
            req.timings.update({
                "queue_s": round(started - req.submitted, 6),
                "encoder_s": round(self._encoder_s, 6),
                "prefill_s": round(max(first - started - self._encoder_s, 0.0), 6),
                "first_token_s": round((min(firsts) if firsts else finished) - req.submitted,
                                       6),
                "decode_s": round(finished - (min(firsts) if firsts else finished), 6),
                "batch_size": len(rows),
            })

    def _step(self, row: _Row, token: int, now: float) -> None:
        if row.done:
            return
        req, params = row.request, row.request.params
        if row.first_token_at is None:
            row.first_token_at = now
        if req.cancelled.is_set():
            self._finish(row, "abort")
            return
        if token in self.eos_ids and not params.ignore_eos:
            self._finish(row, "stop")
            return
        row.token_ids.append(token)
        text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        reason = None
        for stop in params.stop:
            at = text.find(stop)
            if at != -1:
                text, reason = text[:at], "stop"
        if len(row.token_ids) >= params.max_tokens and reason is None:
            reason = "length"
        if text.endswith("\ufffd") and reason is None:
            delta = ""  # a character split across tokens: wait for the rest of its bytes
        else:
            delta = text[len(row.text):] if text.startswith(row.text) else text
            row.text = text
        out = req.outputs[row.index]
        out.text, out.token_ids = row.text, list(row.token_ids)
        if req.on_event:
            req.on_event(TokenEvent(req.request_id, row.index, token, delta, reason))
        if reason:
            row.done = True
            out.finish_reason = reason

    def _finish(self, row: _Row, reason: str) -> None:
        row.done = True
        out = row.request.outputs[row.index]
        if out.finish_reason is None:
            out.finish_reason = reason
            if row.request.on_event:
                row.request.on_event(TokenEvent(row.request.request_id, row.index, None, "",
                                                reason))


@functools.cache
def _hooks() -> tuple[type, type, type]:
    """The per-row sampler, stopping criterion and streamer handed to ``generate``.

    Built once per process (transformers is imported lazily) and given each batch's rows as
    instance state: classes defined inside ``run`` were new objects on every batch, held in
    reference cycles with the batch's rows, requests and media tensors, so all of it waited
    for the cyclic garbage collector and the engine's heap rose in a saw-tooth.
    """
    import torch
    from transformers import LogitsProcessor, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    class Sampler(LogitsProcessor):
        def __init__(self, rows: list[_Row]) -> None:
            self.rows = rows

        def __call__(self, input_ids, scores):
            for i, row in enumerate(self.rows):
                p = row.request.params
                if row.done or p.temperature == 0:
                    continue
                logits = scores[i].float() / p.temperature
                if p.top_k and p.top_k > 0:
                    kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                if p.top_p < 1.0:
                    sorted_p, order = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
                    mask = torch.zeros_like(probs, dtype=torch.bool)
                    mask[order[keep]] = True
                    probs = torch.where(mask, probs, torch.zeros_like(probs))
                    probs = probs / probs.sum()
                token = torch.multinomial(probs, 1, generator=row.generator).item()
                forced = torch.full_like(scores[i], float("-inf"))
                forced[token] = 0.0
                scores[i] = forced
            return scores

    class Stop(StoppingCriteria):
        def __init__(self, rows: list[_Row]) -> None:
            self.rows = rows

        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([row.done or row.request.cancelled.is_set() for row in self.rows],
                                dtype=torch.bool, device=input_ids.device)

    class Streamer(BaseStreamer):
        def __init__(self, runner: TransformersRunner, rows: list[_Row]) -> None:
            self.runner, self.rows, self.prompt_seen = runner, rows, False

        def put(self, value):
            if not self.prompt_seen:  # generate hands over the prompt first
                self.prompt_seen = True
                return
            now = time.perf_counter()
            for i, token in enumerate(value.reshape(-1).tolist()):
                self.runner._step(self.rows[i], int(token), now)

        def end(self):
            return None

    return Sampler, Stop, Streamer
