"""Continuous batching on real (tiny) models: rows join a running batch between decode steps and
leave it when they end, every family gives the greedy tokens it gives alone, --max-num-seqs
counts rows and is never exceeded, a prefill token budget splits joins, and one request's
failure fails it alone. The scheduling rules themselves (FCFS, budgets, chunks, static mode)
are checked model-free in tests/unit/test_scheduler_plan.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.errors import AphroditeError
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from engine.processing.preprocess import MediaItem
from tests.engine_fixtures import FAMILIES, llm
from tests.fixtures import synthetic


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


def media_item(modality: str, seed: int) -> MediaItem:
    if modality == "image":
        return MediaItem("image", decoded=synthetic.image_array(96, 64, seed))
    if modality == "video":
        return MediaItem("video", decoded=np.stack([synthetic.video_frame(i + seed, 96, 64)
                                                     for i in range(4)]))
    t = np.arange(16000) / 16000
    return MediaItem("audio", decoded=((0.3 * np.sin(2 * np.pi * (300 + 50 * seed) * t))
                                       .astype(np.float32), 16000))


def prompts_of(arch: str) -> list:
    """Prompts of very different lengths: text only, one item of each modality the family
    takes, and a long text around an item."""
    model = llm(arch)
    spec = model.loaded.spec
    out = [model.prepare("Just text.", [], None, raw=True)[1]]
    for k, modality in enumerate(spec.modalities):
        out.append(model.prepare(spec.placeholders[modality] + "What is it?",
                                 [media_item(modality, k)], None, False)[1])
    first = spec.modalities[0]
    out.append(model.prepare("A much longer prompt that goes on and on. " * 12
                             + spec.placeholders[first], [media_item(first, 7)], None, False)[1])
    return out


def run_alone(engine: Engine, prompt, params: SamplingParams) -> list[int]:
    req = engine.submit(EngineRequest(prompt, params))
    assert req.done.wait(120) and req.error is None, req.error
    return req.outputs[0].token_ids


def hf_logits(engine: Engine, prompt, tokens: int):
    """The model's own ``generate`` (greedy) on one prompt, alone: the logits of each step,
    the reference the engine's steps (positions, M-RoPE deltas, merged caches, padding) must
    reproduce. (Tiny random models repeat one token, so comparing tokens would prove little.)"""
    import torch

    from engine.processing import device_normalize

    runner = engine.runner
    ids = torch.tensor([prompt.input_ids], dtype=torch.long)
    # pixels the engine normalizes on the model's device, normalized the same way
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              **device_normalize.apply(prompt.mm, runner.normalizers)}
    with torch.inference_mode():
        out = runner.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                                    do_sample=False, pad_token_id=runner.pad_id,
                                    output_logits=True, return_dict_in_generate=True)
    return torch.cat(out.logits).float()


def assert_generate_logits(engine: Engine, logits: dict, req: EngineRequest, prompt,
                           tokens: int) -> None:
    """``req``'s step logits (:func:`record_logits`) are those of the model's own
    ``generate`` on ``prompt`` alone (:func:`hf_logits`)."""
    import torch

    torch.testing.assert_close(logits["stack"](req), hf_logits(engine, prompt, tokens),
                               atol=1e-4, rtol=1e-4)


def record_logits(engine: Engine) -> dict:
    """Every step's logits per request, as the engine sampled from them."""
    import torch

    seen: dict = {}
    sample = engine.runner._sample

    def recording(rows, logits):
        for i, row in enumerate(rows):
            seen.setdefault(row.request.request_id, []).append(logits[i].float().clone())
        return sample(rows, logits)

    engine.runner._sample = recording
    return {"steps": seen, "stack": lambda req: torch.stack(seen[req.request_id])}


def after_tokens(count: int):
    """An on_event callback, and an event it sets once ``count`` tokens have streamed."""
    tokens = []
    reached = threading.Event()

    def on_event(event) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if len(tokens) >= count:
            reached.set()
    return on_event, reached


@pytest.mark.parametrize("arch", FAMILIES)
def test_rows_that_join_a_running_batch_get_their_solo_greedy_tokens(arch):
    """A long generation runs; requests of other lengths and media join it one after another
    while it runs, and each gets exactly the greedy tokens it gets alone (the long one too:
    merging caches, padding and per-row M-RoPE positions change nothing)."""
    import torch

    model = llm(arch)
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8))
    try:
        prompts = prompts_of(arch)
        # the long one leaves slack for the gaps between joins on a loaded machine
        lengths = [64] + [3 + 4 * i for i in range(1, len(prompts))]
        solo = [run_alone(engine, p, greedy(n)) for p, n in zip(prompts, lengths, strict=True)]
        logits = record_logits(engine)
        on_event, started = after_tokens(2)
        long = engine.submit(EngineRequest(prompts[0], greedy(lengths[0]), on_event=on_event))
        assert started.wait(120)
        joined = []
        for prompt, n in zip(prompts[1:], lengths[1:], strict=True):
            joined.append(engine.submit(EngineRequest(prompt, greedy(n))))
            assert joined[-1].done.wait(120)  # the next one joins a batch this one left
        assert long.done.wait(120)
        got = [r.outputs[0].token_ids for r in (long, *joined)]
        assert got == solo
        for req, prompt, n in zip((long, *joined), prompts, lengths, strict=True):
            torch.testing.assert_close(logits["stack"](req), hf_logits(engine, prompt, n),
                                       atol=1e-4, rtol=1e-4)
        # they ran beside the long one: each was in a batch of two or more
        assert all(r.timings["batch_size"] >= 2 for r in joined), [r.timings for r in joined]
        assert engine.stats["batch_size_max"] >= 2
    finally:
        engine.close()


def test_rows_with_different_tile_counts_are_prefilled_together_like_alone():
    """LLaVA-OneVision tiles each image by its size: rows prefilled in one pass get their
    pixel_values zero-padded to one tile count (as its processor pads a batch), and each row's
    logits are those the model's own generate gives it alone."""
    import torch

    model = llm("llava_onevision")
    placeholder = model.loaded.spec.placeholders["image"]
    prompts = [model.prepare(placeholder + "What is it?", [MediaItem(
        "image", decoded=synthetic.image_array(w, h, k))], None, False)[1]
        for k, (w, h) in enumerate([(120, 90), (64, 200), (40, 40)])]
    assert [p.mm["pixel_values"].shape[1] for p in prompts] == [7, 9, 2]  # tiles + the base
    # (a bound that lets the two tiled rows of similar length share a pass, on any device)
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8, prefill_pass_tokens=1024),
                    batch_wait_s=1.0)
    sizes: list[int] = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda rows: (sizes.append(len(rows)), prefill(rows))[1]
    logits = record_logits(engine)
    try:
        reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in prompts]
        for r in reqs:
            assert r.done.wait(120) and r.error is None, r.error
        assert sizes == [3]  # one prefill: no fallback to each alone
        for req, prompt in zip(reqs, prompts, strict=True):
            torch.testing.assert_close(logits["stack"](req), hf_logits(engine, prompt, 4),
                                       atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def test_a_failed_step_leaves_sliding_window_caches_as_they_were():
    """Gemma 3: a decode step raises in its global layer after the sliding-window layer before
    it took the step's token (dropping its oldest column, which no crop brings back). The cache
    is restored, the step is retried per request (split caches, joined again), and every step's
    logits are still those the model's own generate gives each prompt alone."""
    import torch

    model = llm("gemma3")
    prompts = prompts_of("gemma3")[:2]  # text only, and an image
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8), batch_wait_s=1.0)
    steps = {"decode": 0, "raised": 0}
    decode = engine.runner.decode

    def counting(batch):
        steps["decode"] += 1
        return decode(batch)

    def boom(module, args):
        if steps["decode"] == 20 and not steps["raised"]:  # past the 16-token window
            steps["raised"] += 1
            raise RuntimeError("injected failure in the global layer")

    engine.runner.decode = counting
    hook = engine.runner.model.model.language_model.layers[1].register_forward_pre_hook(boom)
    logits = record_logits(engine)
    try:
        reqs = [engine.submit(EngineRequest(p, greedy(30))) for p in prompts]
        for r in reqs:
            assert r.done.wait(120) and r.error is None, r.error
        assert steps["raised"] == 1 and engine.batches == 1
        for req, prompt in zip(reqs, prompts, strict=True):
            torch.testing.assert_close(logits["stack"](req), hf_logits(engine, prompt, 30),
                                       atol=1e-4, rtol=1e-4)
    finally:
        hook.remove()
        engine.close()


def test_a_short_request_behind_a_long_generation_finishes_first():
    """Sent while a 512-token generation runs, a 4-token request is answered while the long one
    is still running (a static batch would hold it until all 512 tokens were out)."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8))
    try:
        prompts = prompts_of("qwen2_5_vl")
        on_event, started = after_tokens(5)
        long = engine.submit(EngineRequest(prompts[1], greedy(512), on_event=on_event))
        assert started.wait(120)
        short = engine.submit(EngineRequest(prompts[0], greedy(4)))
        assert short.done.wait(120) and short.error is None
        assert not long.done.is_set()
        assert len(long.outputs[0].token_ids) < 512
        assert short.outputs[0].token_ids == run_alone(engine, prompts[0], greedy(4))
        long.cancel()
        assert long.done.wait(120) and long.outputs[0].finish_reason == "abort"
    finally:
        engine.close()


def test_max_num_seqs_counts_rows_and_n_rows_sample_like_single_requests():
    """n=16 with --max-num-seqs 8: never more than 8 rows in a step; row i samples with seed + i,
    exactly as a lone n=1 request with that seed does."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8))
    try:
        prompt = prompts_of("qwen2_5_vl")[1]
        params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=16, ignore_eos=True)
        req = engine.submit(EngineRequest(prompt, params))
        other = engine.submit(EngineRequest(prompt, greedy(3)))
        assert req.done.wait(120) and other.done.wait(120) and req.error is None
        assert engine.stats["batch_size_max"] == 8
        assert [len(o.token_ids) for o in req.outputs] == [5] * 16
        for i in (0, 9, 15):
            alone = SamplingParams(max_tokens=5, temperature=1.0, seed=11 + i, ignore_eos=True)
            assert req.outputs[i].token_ids == run_alone(engine, prompt, alone)
    finally:
        engine.close()


def test_max_num_batched_tokens_splits_a_join_into_prefills_that_fit():
    model = llm("qwen2_5_vl")
    prompts = prompts_of("qwen2_5_vl")[:3]
    sizes = [len(p.input_ids) for p in prompts]
    engine = Engine(model.loaded, EngineConfig(max_num_batched_tokens=max(sizes)),
                    batch_wait_s=1.0)
    try:
        reqs = [engine.submit(EngineRequest(p, greedy(6))) for p in prompts]
        for r in reqs:
            assert r.done.wait(120) and r.error is None
        # all three arrived in one window, but no prefill held more than the budget
        assert engine.batches >= 2 and engine.stats["prefill_tokens_total"] == sum(sizes)
        assert [r.outputs[0].token_ids for r in reqs] == [
            run_alone(engine, p, greedy(6)) for p in prompts]
    finally:
        engine.close()


def test_each_prefill_pass_hands_its_first_tokens_out_before_the_next_pass_runs():
    """Rows of very different lengths are prefilled in separate passes (shortest first); the
    short rows' first tokens reach the client (``on_step``, where the server sends a step's
    events) before the long row's pass starts, not after the whole step; each row's
    logits are still its own generate's, and its prefill ends at its own first token."""
    from engine.executor.scheduler import length_groups

    model = llm("qwen2_5_vl")
    prompts = prompts_of("qwen2_5_vl")
    text, long = prompts[0], prompts[-1]
    assert len(length_groups([len(text.input_ids), len(long.input_ids)])) == 2
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8), batch_wait_s=1.0)
    log: list[str] = []
    forward = engine.runner._forward_rows

    def logged(rows, *args):
        log.append("pass " + ",".join(names[r.request.request_id] for r in rows))
        return forward(rows, *args)

    engine.runner._forward_rows = logged
    engine.on_step.append(lambda: log.append("sent"))
    logits = record_logits(engine)
    names: dict[str, str] = {}

    def first_token(name: str):
        def on_event(event) -> None:
            if event.token_id is not None and f"token {name}" not in log:
                log.append(f"token {name}")
        return on_event

    try:
        reqs = []
        for name, prompt in (("long", long), ("text", text)):  # the long one arrives first
            req = EngineRequest(prompt, greedy(3), on_event=first_token(name))
            names[req.request_id] = name
            reqs.append(engine.submit(req))
        for r in reqs:
            assert r.done.wait(120) and r.error is None, r.error
        assert log[:6] == ["pass text", "token text", "sent", "pass long", "token long",
                           "sent"], log
        for req, prompt in zip(reqs, (long, text), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 3)
        t_long, t_text = (r.timings for r in reqs)
        assert t_long["queue_s"] == pytest.approx(t_text["queue_s"], abs=0.05)
        # the long row's prefill took the text row's pass too; the text row's only its own
        assert t_long["prefill_s"] + t_long["encoder_s"] > t_text["prefill_s"]
        assert t_text["encoder_s"] == 0 and t_long["encoder_s"] > 0
    finally:
        engine.close()


def test_a_decode_step_that_raises_fails_only_the_request_that_broke_it():
    """A step fails because of one row (here the runner raises whenever that request is in
    the step): the step is retried per request, that request fails with a 500 and no
    finish event, the others get their solo tokens, and the engine keeps serving."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8), batch_wait_s=1.0)
    prompts = prompts_of("qwen2_5_vl")
    real_decode = engine.runner.decode
    poisoned: list[EngineRequest] = []

    def decode(batch):
        if any(r.request in poisoned and len(r.token_ids) >= 2 for r in batch.rows):
            raise RuntimeError("NaN in the logits")
        return real_decode(batch)

    engine.runner.decode = decode
    try:
        events: list = []
        reqs = [engine.submit(EngineRequest(p, greedy(8), on_event=events.append
                                            if i == 1 else None))
                for i, p in enumerate(prompts)]
        poisoned.append(reqs[1])
        for r in reqs:
            assert r.done.wait(120)
        assert isinstance(reqs[1].error, AphroditeError) and reqs[1].error.status == 500
        assert all(e.finish_reason is None for e in events)
        poisoned.clear()
        for r, p in zip(reqs, prompts, strict=True):
            if r is not reqs[1]:
                assert r.error is None and r.outputs[0].token_ids == run_alone(engine, p,
                                                                               greedy(8))
    finally:
        engine.close()


def test_cancelled_rows_leave_waiting_and_running():
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=1))
    try:
        prompt = prompts_of("qwen2_5_vl")[0]
        on_event, started = after_tokens(1)
        running = engine.submit(EngineRequest(prompt, greedy(512), on_event=on_event))
        assert started.wait(120)
        waiting = engine.submit(EngineRequest(prompt, greedy(512)))  # no room: it waits
        waiting.cancel()
        assert waiting.done.wait(120) and waiting.outputs[0].finish_reason == "abort"
        assert waiting.outputs[0].token_ids == []
        running.cancel()
        assert running.done.wait(120) and running.outputs[0].finish_reason == "abort"
        assert engine.scheduler_stats()["num_rows_running"] == 0
        assert run_alone(engine, prompt, greedy(2))  # still serving
    finally:
        engine.close()


def test_bench_batching_mixed_reports_static_and_continuous_side_by_side(tmp_path):
    """``bench batching --workload mixed``: both schedulings run the same interleaved short and
    long requests; every token is accounted for; a short request sent behind a long generation
    finishes before it only with continuous batching (behaviour, not speed)."""
    import json

    from tests.server.test_cli import run

    result = run("bench", "batching", "--workload", "mixed", "--concurrency", "2",
                 "--num-prompts", "8", "--max-tokens", "24", "--short-tokens", "4",
                 "--behind-long-tokens", "64", "--repeats", "1", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(next(tmp_path.glob("batching-*.json")).read_text())
    assert doc["workload"] == "mixed" and doc["max_num_seqs"] == 2
    for mode in ("static", "continuous"):
        part = doc[mode]
        assert part["failed"] == 0
        # 2 long (24) and 6 short (4) requests per run
        tokens = part["output_throughput"]["median"] * part["wall_s"]["median"]
        assert tokens == pytest.approx(2 * 24 + 6 * 4, rel=1e-6)
    assert doc["static"]["short_behind_long"]["finished_before_long"] == [False]
    assert doc["continuous"]["short_behind_long"]["finished_before_long"] == [True]
    assert "continuous / static output throughput" in result.stdout


def logged_chunks(engine: Engine) -> list[str]:
    """A log that gets "chunk" for each prefill chunk the engine's runner runs."""
    log: list[str] = []
    chunk = engine.runner.prefill_chunk

    def logged_chunk(plan, start, end):
        log.append("chunk")
        return chunk(plan, start, end)

    engine.runner.prefill_chunk = logged_chunk
    return log


def chunked_beside_a_generation(engine: Engine, arch: str, prompt, log: list[str],
                                limit: int) -> tuple[EngineRequest, int]:
    """``prompt`` sent while a long generation runs (its tokens logged as "token"): the
    finished request and its number of chunks, after checking they are the chunks of
    ``limit`` tokens (the media span whole) with a decode step after every one."""
    from engine.executor.scheduler import chunk_bounds

    on_event, started = after_tokens(1)
    running = engine.submit(EngineRequest(prompts_of(arch)[0], greedy(200), on_event=lambda e:
                                          (log.append("token"), on_event(e))))
    assert started.wait(120)
    chunked = engine.submit(EngineRequest(prompt, greedy(6)))
    assert chunked.done.wait(120) and chunked.error is None, chunked.error
    running.cancel()
    assert running.done.wait(120)
    passes = log.count("chunk")
    assert passes == len(chunk_bounds(len(prompt.input_ids), limit, media_span(engine, prompt)))
    between = log[log.index("chunk"):len(log) - log[::-1].index("chunk")]
    assert between.count("token") >= passes - 1  # a decode step after every chunk
    return chunked, passes


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks_between_decode_steps(arch):
    """--max-num-batched-tokens 64 and a prompt of several hundred tokens with media in the
    middle: it is prefilled a chunk per step (the media span whole in one chunk) while a
    running generation keeps receiving tokens between the chunks, and its logits are those the
    model's own generate gives it alone."""
    import torch


    model = llm(arch)
    spec = model.loaded.spec
    modality = spec.modalities[-1]
    long_prompt = model.prepare("Words before the media. " * 30 + spec.placeholders[modality]
                                + "And words after it, quite a few. " * 20,
                                [media_item(modality, 3)], None, False)[1]
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))
    log = logged_chunks(engine)
    logits = record_logits(engine)
    try:
        chunked, passes = chunked_beside_a_generation(engine, arch, long_prompt, log, 64)
        assert passes >= 4
        torch.testing.assert_close(logits["stack"](chunked), hf_logits(engine, long_prompt, 6),
                                   atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def test_a_prompt_over_the_long_prefill_threshold_is_chunked_with_its_solo_logits():
    """--long-prefill-token-threshold 64 under the default budget: a prompt of a few hundred
    tokens with an image, sent while a generation runs, is prefilled in chunks of 64 (the
    image's span whole) with decode steps between them, and its greedy logits are those of
    the model's own generate on it alone; sent into an idle engine it is prefilled whole."""
    import torch


    arch = "qwen2_5_vl"
    model = llm(arch)
    long_prompt = model.prepare("Words before the image. " * 20
                                + model.loaded.spec.placeholders["image"]
                                + "And words after it. " * 20, [media_item("image", 5)],
                                None, False)[1]
    config = EngineConfig(max_num_seqs=8, long_prefill_token_threshold=64,
                          enable_prefix_caching=False)
    assert 64 < len(long_prompt.input_ids) <= config.token_budget
    engine = Engine(model.loaded, config)
    log = logged_chunks(engine)
    logits = record_logits(engine)
    try:
        alone = engine.submit(EngineRequest(long_prompt, greedy(6)))
        assert alone.done.wait(120) and alone.error is None, alone.error
        assert log == []  # nothing running: prefilled whole
        chunked, passes = chunked_beside_a_generation(engine, arch, long_prompt, log, 64)
        assert passes >= 3
        assert chunked.outputs[0].token_ids == alone.outputs[0].token_ids
        torch.testing.assert_close(logits["stack"](chunked), logits["stack"](alone),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits["stack"](chunked), hf_logits(engine, long_prompt, 6),
                                   atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def media_span(engine: Engine, prompt) -> tuple[int, int]:
    at = [i for i, t in enumerate(prompt.input_ids) if t in engine.runner.media_token_ids]
    return at[0], at[-1]


def test_a_cache_layout_the_batch_cannot_merge_is_refused_when_the_engine_starts():
    """Linear-attention (recurrent state) layers cannot be merged, selected or trimmed per
    row: a model with them is a ConfigError naming the layer at start, not a 500 on every
    request's first step. Every registered family's layout passes."""
    import transformers as T

    from engine.errors import ConfigError
    from engine.executor import kv

    config = T.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128)
    kv.check_supported(config)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError) as info:
        kv.check_supported(config)
    assert info.value.code == "unsupported_cache_layout"
    assert "LinearAttentionLayer" in info.value.message
    for arch in FAMILIES:  # what the engine checks when it starts on each family
        kv.check_supported(llm(arch).engine.runner.model.config)


def test_decode_steps_grow_the_cache_in_place_and_survive_merges_leaves_and_restores():
    """A decode step writes its column into spare room of the layer's buffer (no copy of the
    whole cache per token, as transformers' own concatenation makes); a merge, a row leaving,
    a cut of unused columns or a restore after a failed step replace the tensors, and the next
    step copies them into a new buffer. The keys and values always equal plain concatenation."""
    import torch
    import transformers as T

    from engine.executor import kv

    config = T.Qwen2Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128)
    gen = torch.Generator().manual_seed(0)

    def cols(rows: int, n: int):
        return torch.randn(rows, 2, n, 16, generator=gen)

    cache = T.DynamicCache(config=config)
    first = cols(2, 5)
    cache.layers[0].update(first, first.clone())
    kv.reserve(cache)
    layer = cache.layers[0]
    expect = first
    storage = None
    for step in range(3):
        col = cols(2, 1)
        keys, values = layer.update(col, col.clone())
        expect = torch.cat([expect, col], dim=-2)
        assert torch.equal(keys, expect) and torch.equal(values, expect)
        if step == 1:
            storage = keys.untyped_storage().data_ptr()
        if step == 2:
            assert keys.untyped_storage().data_ptr() == storage  # written in place
    saved = kv.snapshot(cache)
    layer.update(cols(2, 1), cols(2, 1))  # a step that "fails" after this layer took it
    kv.restore(cache, saved)
    col = cols(2, 1)
    keys, _ = layer.update(col, col.clone())
    expect = torch.cat([expect, col], dim=-2)
    assert torch.equal(keys, expect)
    other = T.DynamicCache(config=config)
    joined = cols(1, 3)
    other.layers[0].update(joined, joined.clone())
    kv.merge(cache, other)
    kv.select(cache, [2, 0])  # the newcomer and the first row; the second leaves
    kv.drop_left(cache, 2)
    col = cols(2, 1)
    keys, values = layer.update(col, col.clone())
    pad = torch.zeros(1, 2, expect.shape[-2] - 3, 16)
    merged = torch.cat([torch.cat([pad, joined], dim=-2), expect[:1]])[..., 2:, :]
    assert torch.equal(keys, torch.cat([merged, col], dim=-2))
    assert torch.equal(values, keys)


def test_a_request_that_fails_mid_prefill_stops_its_rows_already_running():
    """n=2 over the token budget: row 0 is prefilled in chunks and runs; row 1's chunk
    raises. The request gets the error at once and row 0 takes no more steps (it does not
    decode to max_tokens for a client that only gets an error)."""
    model = llm("qwen2_5_vl")
    prompt = prompts_of("qwen2_5_vl")[-1]  # the long one, over a 32-token budget
    engine = Engine(model.loaded, EngineConfig(max_num_batched_tokens=32,
                                               enable_prefix_caching=False))
    chunk = engine.runner.prefill_chunk

    def failing(plan, start, end):
        if plan.row.index == 1:
            raise RuntimeError("injected failure in row 1's prefill")
        return chunk(plan, start, end)

    engine.runner.prefill_chunk = failing
    try:
        req = engine.submit(EngineRequest(prompt, SamplingParams(
            max_tokens=200, temperature=0, ignore_eos=True, n=2)))
        assert req.done.wait(120)
        assert isinstance(req.error, AphroditeError)
        assert len(req.outputs[0].token_ids) < 200
    finally:
        engine.close()


def join_order(policy: str, prompts: list, priorities: list[int] | None = None,
               **settings) -> list[int]:
    """The order in which ``prompts`` (sent in this order, with these request priorities)
    join a one-row batch that a long generation holds until all of them wait: with
    ``max_num_seqs=1`` each runs alone, so they end in the order they joined. Each gets its
    solo greedy tokens whatever its turn."""
    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=1, scheduling_policy=policy,
                                               **settings))
    try:
        solo = [run_alone(engine, p, greedy(3)) for p in prompts]
        on_event, started = after_tokens(1)
        holder = engine.submit(EngineRequest(prompts[0], greedy(512), on_event=on_event))
        assert started.wait(120)
        ended: list[int] = []
        reqs = [engine.submit(EngineRequest(
            p, greedy(3), priority=(priorities or [0] * len(prompts))[i],
            on_done=lambda req, i=i: ended.append(i))) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120
        while len(engine.waiting) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)  # every request is in the queue before a row can leave
        assert len(engine.waiting) == len(prompts)
        holder.cancel()
        for req in reqs:
            assert req.done.wait(120) and req.error is None, req.error
        assert [r.outputs[0].token_ids for r in reqs] == solo
        assert engine.scheduler.overtaken == {}  # (nothing left behind for requests gone)
        return ended
    finally:
        engine.close()


def test_priority_scheduling_lets_the_lowest_priority_value_join_first():
    """vLLM's --scheduling-policy priority: lower values first, the oldest among equals."""
    prompts = prompts_of("qwen2_5_vl")[:2] * 2
    assert join_order("priority", prompts, [3, 0, -1, 0]) == [2, 1, 3, 0]
    assert join_order("fcfs", prompts) == [0, 1, 2, 3]


def test_shortest_scheduling_lets_short_prompts_pass_a_long_one_a_bounded_number_of_times():
    """--scheduling-policy shortest: the prompts with fewest tokens to prefill join first, but
    a long prompt passed over MAX_OVERTAKES times goes before the younger ones left. (The
    prefix cache is off: the solo runs would leave every prompt's tokens cached, and what
    counts is the tokens left to prefill.)"""
    from engine.config import MAX_OVERTAKES

    text, image, *_, long = prompts_of("qwen2_5_vl")
    assert len(text.input_ids) < len(image.input_ids) < len(long.input_ids)
    cold = {"enable_prefix_caching": False}
    assert join_order("shortest", [long, image, text, image], **cold) == [2, 1, 3, 0]
    # a long prompt sent first, then more short ones than it may be passed over by
    order = join_order("shortest", [long] + [text] * (MAX_OVERTAKES + 2), **cold)
    assert order == [*range(1, MAX_OVERTAKES + 1), 0, MAX_OVERTAKES + 1, MAX_OVERTAKES + 2]
