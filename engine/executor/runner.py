"""The transformers runner: prefill and decode steps over a running batch of rows.

A row is one sequence (a request with ``n`` > 1 has ``n`` rows). Rows that join are prefilled
together (left-padded, their media tensors concatenated in order, positions by the model's own
rule: 3-D M-RoPE for Qwen-VL), then stepped one token at a time with the rows already running,
each at its own position; their caches are merged (see :mod:`engine.executor.kv`). Each row
samples with its own temperature/top-k/top-p/seed and hands every new token to its request as
it is produced (:func:`engine.executor.outputs.add_token`, where it ends on its own: max_tokens,
EOS, stop strings, cancellation). The engine's lifecycle around these forward passes asks
only for :class:`~engine.executor.runner_protocol.Runner`'s members. Hooks on
the vision/audio encoder time it, so prefill, encoder, first token and decode are reported
separately.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.cpus import usable_cpus, use_torch_threads
from engine.executor import grammar, kv, logits_processors, media_embeds, sampler
from engine.executor.detokenize import byte_tokens
from engine.executor.outputs import add_token
from engine.executor.prefetch import Prefetcher
from engine.executor.request import EngineRequest
from engine.executor.row import Row
from engine.executor.runner_protocol import PrefillIncomplete
from engine.executor.scheduler import length_groups
from engine.executor.warm_cache import WarmCaches, media_span
from engine.models import lean_decode, parts
from engine.models.encoder import time_encoder
from engine.models.loader import LoadedModel
from engine.processing import device_normalize
from engine.processing.preprocess import concat


@dataclass(eq=False)
class RunningBatch:
    """Rows stepped together: their cache (rows left-padded to one length) and the attention
    mask over it."""

    rows: list[Row]
    cache: Any
    mask: Any
    mrope: bool
    #: buffers with room for the mask's next columns (:meth:`next_keep`): the mask they were
    #: last grown into, its int and bool buffers and their numpy views
    _room: list[Any] | None = field(default=None, repr=False)

    def next_keep(self) -> tuple[Any, int]:
        """The mask as bools with the next step's column of ones (the whole-step kernel's
        ``keep``): a buffer with room for more columns, and how many of them are the mask's
        (the first ``columns``). No tensor is made or copied while the buffers last (a step
        once copied the mask with ``torch.cat`` and again with ``.bool()``, and each PyTorch
        call lets the engine's other threads take the GIL just before the step): the new
        column is written through numpy. A step that takes it calls :meth:`took`; a mask set
        any other way (a join, rows leaving, the other path's step) is not the one the
        buffers hold, and the next call copies it into new ones."""
        import torch

        mask, room = self.mask, self._room
        width = mask.shape[1]
        if room is None or room[0] is not mask or room[1].shape[1] <= width:
            rows = mask.shape[0]
            capacity = width + 1 + max(kv._SPARE_COLUMNS, (width + 1) // 4)
            longs = mask.new_zeros((rows, capacity))
            longs[:, :width] = mask
            bools = torch.zeros((rows, capacity), dtype=torch.bool)
            bools[:, :width] = mask != 0
            room = self._room = [mask, longs, bools, longs.numpy(), bools.numpy()]
        room[3][:, width] = 1
        room[4][:, width] = True
        return room[2], width + 1

    def took(self, columns: int) -> None:
        """The step took :meth:`next_keep`'s mask of ``columns``: it is the batch's now."""
        room = self._room
        if room is None:
            raise RuntimeError("RunningBatch.took() without next_keep()")
        self.mask = room[0] = room[1].narrow(1, 0, columns)

    def join(self, other: RunningBatch) -> None:
        import torch

        kv.merge(self.cache, other.cache)
        width = max(self.mask.shape[1], other.mask.shape[1])
        pad = [m if m.shape[1] == width else torch.cat(
            [m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)
            for m in (self.mask, other.mask)]
        self.mask = torch.cat(pad)
        self.rows += other.rows
        self.mrope = self.mrope or other.mrope

    def keep(self, rows: list[Row]) -> None:
        """Only these rows stay (their order kept); columns no one attends to are cut."""
        wanted = set(rows)
        index = [i for i, r in enumerate(self.rows) if r in wanted]
        if len(index) != len(self.rows):
            kv.select(self.cache, index)
            self.mask = self.mask[index]
            self.rows = [self.rows[i] for i in index]
        if self.rows:
            unused = int(self.mask.any(dim=0).long().argmax())
            kv.drop_left(self.cache, unused)
            self.mask = self.mask[:, unused:]

    def split(self, rows: list[Row]) -> RunningBatch:
        """A copy holding only these rows (for running them apart)."""
        index = [self.rows.index(r) for r in rows]
        return RunningBatch(list(rows), kv.take(self.cache, index), self.mask[index],
                            self.mrope)


@dataclass(eq=False)
class ChunkedPrefill:
    """A prompt longer than the step's token budget, prefilled a chunk per step (the chunks
    the scheduler plans) while the running batch keeps decoding."""

    row: Row
    inputs: dict[str, Any]
    positions: Any
    cache: Any
    mrope: bool
    rope_delta: int
    #: prompt tokens prefilled so far: the next chunk starts here
    done: int = 0
    #: when the first chunk was planned: the prefill's start in the stage timings
    started: float = field(default_factory=time.perf_counter)
    #: the prompt's block hashes (prefix caching): its blocks are stored after the last chunk
    hashes: list[bytes] = field(default_factory=list)
    #: the prompt's merged input embeddings, when its cached prefix ends inside its media
    #: span: every chunk is fed from them (see media_embeds)
    embeds: Any = None


#: the media tensors a prefill whose media are cached leaves out (what the encoders read; the
#: position rules read only the grids and token types)
_MEDIA_TENSORS = frozenset({"pixel_values", "pixel_values_videos", "input_features"})


class TransformersRunner:
    """Prefills and steps rows of :class:`EngineRequest` on a Hugging Face model (the
    engine's :class:`~engine.executor.runner_protocol.Runner`)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """``config``: where the model runs (device, dtype) and its caches' settings."""
        self.loaded = loaded
        self.device = config.device
        self.model = loaded.model(config.device, config.dtype, config.quantization)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        kv.check_supported(self.model.config)
        self.tokenizer = loaded.tokenizer
        self.byte_ids = byte_tokens(self.tokenizer)
        self.normalizers = device_normalize.normalizers(loaded)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else next(iter(self.eos_ids), 0)
        self.encoder_s = 0.0
        #: called after each prefill pass's first tokens were handed on (the engine sends
        #: them out there: a step's later passes do not hold them back)
        self.on_first_tokens: Callable[[], None] | None = None
        #: the most tokens one prefill pass of several rows computes (see length_groups)
        self.pass_tokens = config.pass_tokens
        time_encoder(self.model, loaded.spec.encoder_attr, self._add_encoder_time)
        tok = self.tokenizer
        self.media_token_ids = {tok.convert_tokens_to_ids(loaded.spec.feature_token(m))
                                for m in loaded.spec.expansion_tokens}
        # transformers 5 names the cache argument ``cache`` (``past_key_values`` before)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        encoder = getattr(self.model, loaded.spec.encoder_attr, None) or getattr(
            getattr(self.model, "model", None), loaded.spec.encoder_attr, None)
        text_model = parts.language_model(self.model) \
            if loaded.spec.resume_in_media else None
        self._merged_embeds = media_embeds.MergedEmbeds(self.model, text_model) \
            if text_model is not None else None
        #: a prefill may start inside a prompt's media span (a cached prefix is not cut back)
        self.resumes_in_media = self._merged_embeds is not None
        #: the model's decode step without transformers' machinery, where it has one
        self._lean_decode = lean_decode.for_model(
            self.model, config.max_num_seqs if config.compile_decode else None,
            config.decode_threads or config.num_threads or usable_cpus())
        if hasattr(self._lean_decode, "start"):  # (--compile-decode: in the background)
            self._lean_decode.start()
        #: positions (and on a CPU normalized media) prepared for the next prefills
        self._rope_lock = threading.Lock()  # (the model keeps the last rope deltas it made)
        self.prefetcher = Prefetcher(self._positions, self._normalized
                                     if str(self.device) == "cpu" else None)
        self.caches = WarmCaches(self.model, encoder, self.media_token_ids, config,
                                 inside_media=self.resumes_in_media)
        self.prefix_cache, self.encoder_cache = self.caches.prefix, self.caches.encoder
        self._grammars: grammar.Grammars | None = None  # made on the first constraint
        self._grammars_lock = threading.Lock()

    def grammars(self) -> grammar.Grammars:
        """The compiled grammars for this model's tokenizer (xgrammar is imported, and the
        tokenizer read, on the first request with a constraint). Any thread."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = grammar.Grammars(
                    self.tokenizer, grammar.logits_vocab(self.loaded.config, self.tokenizer),
                    self.eos_ids)
            return self._grammars

    def set_threads(self, count: int) -> None:
        """Run the calling thread's torch operations on ``count`` threads."""
        use_torch_threads(count)

    def prefetch(self, requests: Iterable[EngineRequest]) -> None:
        """Prepare the next prefills' positions (and normalized media) ahead."""
        self.prefetcher.schedule(requests)

    def close(self) -> None:
        """Stop the prefetch and compile threads (the decode step's compiles too)."""
        self.prefetcher.close()
        if hasattr(self._lean_decode, "close"):  # (--compile-decode's background compiles)
            self._lean_decode.close()
        self.close_grammars()

    def close_grammars(self) -> None:
        """Stop the compile threads (a compile under way is left to finish)."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    @property
    def decode_path(self) -> str:
        """How decode steps run: "lean" (:mod:`engine.models.lean_decode`), "lean-compiled"
        (with ``--compile-decode``'s graphs, bucket by bucket as they are compiled) or
        "forward" (the model's own forward)."""
        if self._lean_decode is None:
            return "forward"
        return "lean-compiled" if hasattr(self._lean_decode, "ready") else "lean"

    def _add_encoder_time(self, seconds: float) -> None:
        self.encoder_s += seconds

    def _inputs(self, rows: list[Row], pixels: bool = True) -> dict[str, Any]:
        """The rows' model inputs (``pixels`` False: without the media's pixel and audio
        tensors, for a prefill whose media the prefix cache covers: nothing is moved to the
        device or normalized for it)."""
        media = [self.prefetcher.media(r.request) for r in rows] if pixels else None
        return self._tensors([r.request.prompt for r in rows], media, self.device)

    def _tensors(self, prompts: list[Any], media: list[dict[str, Any]] | None,
                 device: Any) -> dict[str, Any]:
        """The prompts' model inputs on ``device``, left-padded; their media tensors with
        ``media[i]``'s in place of prompt ``i``'s own (None: without media tensors)."""
        import torch

        seqs = [p.input_ids for p in prompts]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
        inputs: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        types_key = self.loaded.spec.token_types_key
        merged: dict[str, list[Any]] = {}
        for i, p in enumerate(prompts):
            for key, value in p.mm.items():
                if key == types_key:
                    continue
                if media is not None:
                    merged.setdefault(key, []).append(media[i].get(key, value))
                elif key not in _MEDIA_TENSORS:
                    merged.setdefault(key, []).append(value)
        padded = self.loaded.spec.padded_keys
        for key, values in merged.items():
            inputs[key] = concat(values, key in padded).to(device)
        inputs = device_normalize.apply(inputs, self.normalizers)  # on the model's device
        if any(types_key in p.mm for p in prompts):
            types = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                row_types = p.mm.get(types_key)
                if row_types is not None:
                    types[i, width - row_types.shape[1]:] = row_types[0]
            inputs[types_key] = types.to(device)
        return inputs

    def _positions(self, prompt: Any) -> tuple[Any, int | None]:
        """A prompt's positions by the model's own rule (3-D M-RoPE for Qwen-VL: vision
        tokens by their grid, text after them), as ``generate`` computes them, on the CPU, and
        its rope delta (None without M-RoPE). Any thread."""
        inputs = self._tensors([prompt], None, "cpu")
        with self._rope_lock:
            positions = self.model._prepare_position_ids_for_generation(inputs["input_ids"],
                                                                       dict(inputs))
            deltas = getattr(getattr(self.model, "model", None), "rope_deltas", None)
        mrope = deltas is not None and positions.ndim == 3
        return positions, int(deltas[0, 0]) if mrope else None

    def _normalized(self, prompt: Any) -> dict[str, Any]:
        """A prompt's deferred media tensors normalized (a CPU device). Any thread."""
        return {k: v for k, v in device_normalize.apply(prompt.mm, self.normalizers).items()
                if v is not prompt.mm[k]}

    def cached_tokens(self, request: EngineRequest) -> int:
        """How many of ``request``'s prompt tokens a prefill now takes from the prefix cache
        (the scheduler's ``SeqState.cached_tokens``; not counted as a lookup)."""
        return self.caches.cached_tokens(request.prompt)

    def cache_stats(self) -> dict[str, float]:
        """The prefix and encoder caches' counters for /metrics."""
        return self.caches.stats()

    def prefill(self, rows: list[Row]) -> RunningBatch:
        """The prompts of ``rows`` prefilled, each from the end of its cached prefix (none:
        the whole prompt), in as few forward passes as keep the padding small (rows grouped
        by the tokens they prefill, :func:`length_groups`, shortest first); in each, the
        cached keys and values left-padded to the longest prefix, the uncached tokens
        left-padded to the longest rest, the media of the rows whose media span is not cached
        concatenated in order. After each pass its rows' first tokens are sampled and handed
        on, and :attr:`on_first_tokens` is called (so they go out before the next pass runs),
        with the positions their next tokens take. A pass that raises before any was handed
        on raises as it is; after, :class:`PrefillIncomplete` holds the rows handed on."""
        from transformers import DynamicCache

        if not rows:
            raise ValueError("a prefill needs at least one row")
        self.encoder_s = 0.0
        found = [self.caches.lookup(row.request, row.index == 0) for row in rows]
        rest = [len(row.request.prompt.input_ids) - length
                for row, (_, length) in zip(rows, found, strict=True)]
        groups = length_groups(rest, max_tokens=self.pass_tokens)
        # each pass's rows, their block hashes and cached lengths
        passes = [([rows[i] for i in g], [found[i][0] for i in g], [found[i][1] for i in g])
                  for g in groups]
        # Every row's cached keys and values are taken before any pass stores new blocks: a
        # full cache would evict blocks just looked up.
        caches = []
        for _, hashes, cached in passes:
            cache = DynamicCache(config=self.model.config)
            self.caches.fill_rows(cache, hashes, cached)
            caches.append(cache)
        batch: RunningBatch | None = None
        for n, ((group, hashes, cached), cache) in enumerate(zip(passes, caches,
                                                                   strict=True)):
            try:
                part, logits = self._forward_rows(group, hashes, cached, cache)
                self._advance(list(part.rows), logits)
            except Exception as exc:
                if batch is None:
                    raise
                left = [row for later, _, _ in passes[n:] for row in later]
                raise PrefillIncomplete(batch, left, exc) from exc
            for row in part.rows:
                row.encoder_s = self.encoder_s
            if batch is None:
                batch = part
            else:
                batch.join(part)
            if self.on_first_tokens is not None:
                self.on_first_tokens()
        return batch  # type: ignore[return-value]  (rows is not empty: one pass ran)

    def prefill_requests(self, requests: list[EngineRequest]) -> RunningBatch:
        """One row of each of ``requests`` prefilled (unseeded): the running batch to step
        with :meth:`decode` (``bench decode-step`` times its steps)."""
        return self.prefill([Row(req, 0, None) for req in requests])

    def _row_positions(self, row: Row) -> tuple[Any, int | None]:
        """A row's prompt positions and rope delta (see :meth:`_positions`), prepared ahead
        when the prefetcher got to them."""
        prepared = self.prefetcher.get(row.request)
        return prepared.positions, prepared.delta

    def _forward_rows(self, rows: list[Row], hashes: list[list[bytes]], cached: list[int],
                      cache: Any) -> tuple[RunningBatch, Any]:
        """One forward pass over the uncached tokens of ``rows`` (the first ``cached[i]`` of
        row ``i`` are in ``cache``, from the prefix cache): their batch and last logits
        (nothing handed on); their blocks go into the prefix cache."""
        import torch

        prefix = max(cached)
        seqs = [r.request.prompt.input_ids for r in rows]
        rest = [len(s) - c for s, c in zip(seqs, cached, strict=True)]
        width = max(rest)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), prefix + width), dtype=torch.long)
        encoded = []  # rows whose media the encoder reads in this pass
        resumed = False  # a row's cached prefix ends inside its media span
        parts, deltas, whole = [], [], []
        spec = self.loaded.spec
        types = None
        for i, (row, seq, c, n) in enumerate(zip(rows, seqs, cached, rest, strict=True)):
            ids[i, width - n:] = torch.tensor(seq[c:], dtype=torch.long)
            mask[i, prefix - c:prefix] = 1
            mask[i, prefix + width - n:] = 1
            media = media_span(seq, self.media_token_ids)
            if media is not None and c <= media[1]:
                encoded.append(row)
                resumed = resumed or c > media[0]
            positions, delta = self._row_positions(row)
            whole.append(positions)
            pad = positions.new_zeros((*positions.shape[:-1], width - n))
            parts.append(torch.cat([pad, positions[..., c:]], dim=-1))
            deltas.append(delta)
            row_types = row.request.prompt.mm.get(spec.token_types_key)
            if row_types is not None:
                if types is None:
                    types = torch.zeros((len(rows), width), dtype=torch.long)
                types[i, width - n:] = row_types[0, c:]
        keyed: Any = contextlib.nullcontext()
        if resumed:  # every row from its merged embeddings, after its cached prefix
            inputs: dict[str, Any] = {"inputs_embeds": self._rows_embeds(
                rows, whole, cached, width, encoded, ids)}
        else:
            inputs = {k: v for k, v in self._inputs(encoded).items()
                      if k not in ("input_ids", "attention_mask",
                                   spec.token_types_key)} if encoded else {}
            inputs["input_ids"] = ids.to(self.device)
            if types is not None:
                inputs[spec.token_types_key] = types.to(self.device)
            keyed = self.caches.keyed([r.request.prompt for r in encoded])
        inputs["attention_mask"] = mask.to(self.device)
        positions = torch.cat(parts, dim=-2).to(self.device)
        mrope = any(d is not None for d in deltas)
        try:
            with torch.inference_mode(), keyed:
                out = self.model(**inputs, position_ids=positions, **{self._cache_arg: cache},
                                 use_cache=True, logits_to_keep=1)
        finally:
            for row in rows:
                Prefetcher.release(row.request)
        lengths = [len(s) for s in seqs]
        total = max(lengths)
        if prefix:  # each row's prefix and rest side by side, left-padded
            kv.compact(cache, [list(range(prefix - c, prefix)) + list(
                range(prefix + width - n, prefix + width)) for c, n in zip(cached, rest,
                                                                            strict=True)])
            mask = torch.zeros((len(rows), total), dtype=torch.long)
            for i, length in enumerate(lengths):
                mask[i, total - length:] = 1
            mask = mask.to(self.device)
        else:
            mask = inputs["attention_mask"]
        for i, row in enumerate(rows):
            row.position = lengths[i]
            row.rope_delta = deltas[i] or 0
            self.caches.store(cache, i, total - lengths[i], hashes[i])
        return RunningBatch(rows, cache, mask, mrope), out.logits[:, -1, :]

    def _merged(self, row: Row, positions: Any, inputs: dict[str, Any] | None = None) -> Any:
        """``(1, tokens, hidden)``: the embeddings of ``row``'s whole prompt with its media
        features in place, as the model merges them (its encoder output from the encoder
        cache when it holds the prompt's items); ``inputs``: the row's model inputs with its
        media tensors, when they were built already."""
        import torch

        with torch.inference_mode(), self.caches.keyed([row.request.prompt]):
            return self._merged_embeds(inputs if inputs is not None else self._inputs([row]),
                                       positions.to(self.device))

    def _rows_embeds(self, rows: list[Row], positions: list[Any], cached: list[int],
                     width: int, encoded: list[Row], ids: Any) -> Any:
        """``(rows, width, hidden)``: each row's input embeddings after its first
        ``cached[i]`` tokens, left-padded with zeros (the mask hides the padding): merged
        with its media for a row whose media are among them (``encoded``), else its tokens'
        (``ids``, left-padded to ``width``) from the embedding table."""
        import torch

        with torch.inference_mode():
            out = self.model.get_input_embeddings()(ids.to(self.device))
            for i, (row, pos, c) in enumerate(zip(rows, positions, cached, strict=True)):
                if row in encoded:
                    full = self._merged(row, pos)[0, c:]
                    out[i, width - full.shape[0]:] = full
        return out

    def start_chunked(self, row: Row) -> ChunkedPrefill:
        """Set up the chunked prefill of one row's prompt (positions computed once, for the
        whole prompt, by the model's own rule), from the end of its cached prefix: the
        scheduler's first chunk starts at ``done``."""
        self.encoder_s = 0.0
        hashes, length = self.caches.lookup(row.request, row.index == 0)
        return self._plan(row, hashes, length)

    def _plan(self, row: Row, hashes: list[bytes], cached: int) -> ChunkedPrefill:
        """A row's prefill after its first ``cached`` tokens, whose keys and values the cache
        starts with."""
        from transformers import DynamicCache

        ids = row.request.prompt.input_ids
        media = media_span(ids, self.media_token_ids)
        inputs = self._inputs([row], pixels=media is None or cached <= media[1])
        Prefetcher.release(row.request)  # (the plan holds its inputs)
        positions, delta = self._row_positions(row)
        positions = positions.to(self.device)
        embeds = None
        if media is not None and media[0] < cached <= media[1]:
            embeds = self._merged(row, positions, inputs)
            inputs = {k: v for k, v in inputs.items() if k not in _MEDIA_TENSORS}
        cache = DynamicCache(config=self.model.config)
        self.caches.fill_rows(cache, [hashes], [cached])
        return ChunkedPrefill(row, inputs, positions, cache, delta is not None, delta or 0,
                              done=cached, hashes=hashes, embeds=embeds)

    def prefill_chunk(self, plan: ChunkedPrefill, start: int, end: int) -> RunningBatch | None:
        """Prefill prompt tokens ``[start, end)`` (the chunk with media holds all of it);
        after the last chunk, the row (its first token handed on) as a batch of one, ready to
        join."""
        logits = self._forward_chunk(plan, start, end)
        if logits is None:
            return None
        batch = RunningBatch([plan.row], plan.cache, plan.inputs["attention_mask"], plan.mrope)
        self._advance([plan.row], logits)
        plan.row.encoder_s = self.encoder_s  # the prompt's chunks' encoder time
        return batch

    def _forward_chunk(self, plan: ChunkedPrefill, start: int, end: int) -> Any:
        """Forward prompt tokens ``[start, end)`` of ``plan``; after the last chunk, the row's
        last logits (nothing handed on; its blocks go into the prefix cache), else None."""
        import torch

        inputs = plan.inputs
        chunk = {"input_ids": inputs["input_ids"][:, start:end],
                 "attention_mask": inputs["attention_mask"][:, :end]}
        spec = self.loaded.spec
        if spec.token_types_key in inputs:
            # Gemma 3 reads them by position over the whole cache (bidirectional attention
            # within each image): from the prompt's start; M-RoPE families: the chunk's own.
            chunk[spec.token_types_key] = inputs[spec.token_types_key][
                :, 0 if spec.bidirectional_media else start:end]
        ids = chunk["input_ids"][0].tolist()
        keyed: Any = contextlib.nullcontext()
        if plan.embeds is not None:  # resumed inside the media span: fed from the embeddings
            chunk["inputs_embeds"] = plan.embeds[:, start:end]
            del chunk["input_ids"]
        elif any(t in self.media_token_ids for t in ids):  # the chunk with the media span
            chunk.update({k: v for k, v in inputs.items() if k not in (
                "input_ids", "attention_mask", spec.token_types_key)})
            keyed = self.caches.keyed([plan.row.request.prompt])
        with torch.inference_mode(), keyed:
            out = self.model(**chunk, position_ids=plan.positions[..., start:end],
                             **{self._cache_arg: plan.cache}, use_cache=True, logits_to_keep=1)
        plan.done = end
        if end < inputs["input_ids"].shape[1]:
            return None
        row = plan.row
        row.position = int(inputs["attention_mask"].sum())
        row.rope_delta = plan.rope_delta
        self.caches.store(plan.cache, 0, 0, plan.hashes)
        return out.logits[:, -1, :]

    def decode(self, batch: RunningBatch) -> None:
        """One decode step for every row of ``batch``: each row's last token goes in, its next
        token comes out. On an exception the cache is as it was before the step."""
        import torch

        if self._decode_at(batch):
            return
        rows = batch.rows
        ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)
        text = torch.tensor([[r.position] for r in rows], dtype=torch.long, device=self.device)
        positions = text
        if batch.mrope:
            deltas = torch.tensor([[r.rope_delta] for r in rows], dtype=torch.long,
                                  device=self.device)
            positions = (text + deltas).unsqueeze(0).expand(3, -1, -1)
        kv.reserve(batch.cache)
        before = kv.snapshot(batch.cache)
        try:
            with torch.inference_mode():
                if self._lean_decode is not None:
                    logits = self._lean_decode(ids, mask, positions, batch.cache)
                else:
                    logits = self.model(input_ids=ids, attention_mask=mask,
                                        position_ids=positions, use_cache=True,
                                        **{self._cache_arg: batch.cache}).logits[:, -1, :]
        except BaseException:
            kv.restore(batch.cache, before)
            raise
        batch.mask = mask
        for row in rows:
            row.position += 1
        self._advance(rows, logits)

    def _decode_at(self, batch: RunningBatch) -> bool:
        """The decode step through the lean kernel step's fast path (``at``: the rows' tokens
        and positions as lists, the whole step in one call, each row's greedy token from it),
        where it takes the batch; False where it does not (nothing changed: :meth:`decode`'s
        own path runs the step). Outside ``inference_mode``: it makes no tensor before the
        call (the logits are the step's buffer, reused; the mask's view comes after), and
        its call leaves the caches as they were when it fails."""
        at = getattr(self._lean_decode, "at", None)
        if at is None:
            return False
        rows = batch.rows
        if batch.mrope:
            if any(r.rope_delta is None for r in rows):
                return False
            positions = [r.position + r.rope_delta for r in rows]
        else:
            positions = [r.position for r in rows]
        keep, columns = batch.next_keep()
        out = at([r.last_token for r in rows], positions, 3 if batch.mrope else 2, keep,
                 columns, batch.cache)
        if not out:
            return False
        logits, greedy = out
        batch.took(columns)
        for row in rows:
            row.position += 1
        self._advance(rows, logits, greedy)
        return True

    def _advance(self, rows: list[Row], logits: Any, greedy: list[int] | None = None) -> None:
        """Each row's next token from ``logits``; ``greedy``: each row's first maximal logit,
        computed with them (taken where every row is greedy and nothing changes the logits
        before the sampler: no grammar, no logits processor)."""
        if greedy is not None and all(
                r.request.params.temperature == 0 and r.request.grammar is None and
                not logits_processors.needs_processing(r.request.params) for r in rows):
            tokens = greedy
        else:
            logits = grammar.mask_logits(rows, logits, self._grammars)
            tokens = self._sample(rows, logits_processors.apply(rows, logits, self.tokenizer,
                                                                self.eos_ids))
        logprobs = sampler.logprobs(rows, logits, tokens)
        now = time.perf_counter()
        for row, token, lp in zip(rows, tokens, logprobs, strict=True):
            row.last_token = token
            add_token(row, token, now, lp, eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                      byte_ids=self.byte_ids)

    def _sample(self, rows: list[Row], logits: Any) -> list[int]:
        return sampler.sample(rows, logits)
