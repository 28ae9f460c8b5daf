"""One request must not hurt another in the engine: when a batch fails, the request that
broke it fails alone and its batch-mates get the answers they would have got on their own."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.config import EngineConfig
from engine.errors import AphroditeError
from engine.executor.engine import Engine
from engine.executor.request import EngineRequest
from engine.executor.sampling import SamplingParams
from engine.processing.preprocess import MediaItem
from tests.engine_fixtures import llm

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"


def _image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)


def test_a_request_that_breaks_the_model_fails_alone_and_its_batch_mates_are_answered():
    model = llm("qwen2_5_vl")
    good = [model.prepare(IMAGE_PROMPT, [MediaItem("image", decoded=_image(k))], None,
                          False)[1] for k in range(2)]
    good.append(model.prepare("Just text.", [], None, raw=True)[1])
    # Poison: half the image patches are gone, so the vision tower's output no longer fits
    # the prompt's image placeholders and the forward pass raises.
    pixels = good[0].mm["pixel_values"]
    # (Other pixels are another item: their own content key, or the engine's caches would
    # rightly hand it good[0]'s encoder output.)
    bad = dataclasses.replace(good[0], mm={**good[0].mm, "pixel_values": pixels[: len(pixels)
                                                                                // 2]},
                              mm_hashes=["poisoned"])
    # A long batching window puts all four into the first forward pass.
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8), batch_wait_s=2.0)
    try:
        reqs = [engine.submit(EngineRequest(p, GREEDY)) for p in (good[0], bad, *good[1:])]
        for r in reqs:
            assert r.done.wait(120)
        victims = [reqs[0], *reqs[2:]]
        assert isinstance(reqs[1].error, AphroditeError)
        assert all(r.error is None for r in victims), [r.error for r in victims]
        # Their answers are what each gets alone (greedy). The first prefill held all four
        # in two passes: the text row's (shortest first) handed its first token on, then the
        # images' pass failed, and each image request was prefilled again alone.
        assert engine.batches == 1 + 3
        for r, prompt in zip(victims, (good[0], *good[1:]), strict=True):
            solo = engine.submit(EngineRequest(prompt, GREEDY))
            assert solo.done.wait(120) and solo.error is None
            assert r.outputs[0].token_ids == solo.outputs[0].token_ids
            assert len(r.outputs[0].token_ids) == 4 and r.outputs[0].finish_reason == "length"
    finally:
        engine.close()


def test_a_failed_request_streams_no_finish_event():
    """When the batch fails, the runner sends no made-up "length" finish to anyone: the
    request that failed ends with its error only."""
    model = llm("qwen2_5_vl")
    prompt = model.prepare(IMAGE_PROMPT, [MediaItem("image", decoded=_image(7))], None,
                           False)[1]
    pixels = prompt.mm["pixel_values"]
    bad = dataclasses.replace(prompt, mm={**prompt.mm, "pixel_values": pixels[:4]})
    events = []
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8))
    try:
        req = engine.submit(EngineRequest(bad, GREEDY, on_event=events.append))
        assert req.done.wait(120)
        assert isinstance(req.error, AphroditeError) and req.error.status == 500
        assert events == []
    finally:
        engine.close()


def test_a_request_whose_later_pass_fails_ends_with_the_rows_it_had_handed_on():
    """A request's two rows in separate prefill passes: the first hands its first token on,
    the second's pass fails (and fails again alone). The request ends with its error, its
    handed-on row leaves the running batch with it (the engine goes idle, no row left
    behind), and the other request of that prefill is answered as alone."""
    model = llm("qwen2_5_vl")
    texts = [model.prepare(f"Question number {k}: what is it?", [], None, raw=True)[1]
             for k in range(2)]
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8, prefill_pass_tokens=1),
                    batch_wait_s=2.0)
    forward = engine.runner._forward_rows
    broken = EngineRequest(texts[0], dataclasses.replace(GREEDY, n=2))

    def failing(rows, *args):
        if any(r.request is broken and r.index == 1 for r in rows):
            raise RuntimeError("this row's pass breaks")
        return forward(rows, *args)

    engine.runner._forward_rows = failing
    events = []
    broken.on_event = events.append
    try:
        engine.submit(broken)
        other = engine.submit(EngineRequest(texts[1], GREEDY))
        assert broken.done.wait(120) and other.done.wait(120)
        assert isinstance(broken.error, AphroditeError) and broken.error.status == 500
        assert [e.index for e in events if e.token_id is not None] == [0]  # row 0's first
        assert other.error is None
        solo = engine.submit(EngineRequest(texts[1], GREEDY))
        assert solo.done.wait(120) and solo.error is None
        assert other.outputs[0].token_ids == solo.outputs[0].token_ids
        assert engine.scheduler_stats()["num_rows_running"] == 0
        assert engine.running is None and not engine.waiting
    finally:
        engine.close()
