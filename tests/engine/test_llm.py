"""The offline API and the executor on every tiny family: generate, chat, sampling,
streaming, cancellation, batching, and the cache's effect on outputs."""

from __future__ import annotations

import base64
import re
import threading
import time

import numpy as np
import pytest
from PIL import Image

from engine import SamplingParams
from engine.errors import ConfigError, InvalidRequestError
from engine.executor.request import EngineRequest
from engine.processing.preprocess import MediaItem
from tests.engine_fixtures import llm
from tests.fixtures import synthetic

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def img(seed: int = 0, w: int = 96, h: int = 80) -> Image.Image:
    return Image.fromarray(synthetic.image_array(w, h, seed))


def frames(n: int = 4) -> np.ndarray:
    return np.stack([synthetic.video_frame(i, 96, 64) for i in range(n)])


def wave(seconds: float = 1.0) -> tuple[np.ndarray, int]:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000


CASES = [
    ("qwen2_5_vl", {"image": img()}), ("qwen2_5_vl", {"video": frames()}),
    ("qwen2_vl", {"image": [img(1), img(2)]}), ("qwen2_vl", {"video": frames()}),
    ("qwen3_vl", {"image": [img(1), img(2)]}), ("qwen3_vl", {"video": frames()}),
    ("llava", {"image": img()}), ("qwen2_audio", {"audio": wave()}),
    # two images tiled differently (2x2 and 1x3 tiles + the base): padded to one tile count
    ("llava_onevision", {"image": [img(1, 120, 90), img(2, 64, 200)]}),
    ("llava_onevision", {"video": frames()}),
    ("internvl", {"image": [img(1, 120, 90), img(2, 64, 200)]}), ("internvl", {"video": frames()}),
    ("gemma3", {"image": [img(1), img(2)]}),
    ("smolvlm", {"image": [img(1, 120, 90), img(2, 64, 200)]}), ("smolvlm", {"video": frames()}),
]


@pytest.mark.parametrize("arch,mm", CASES, ids=[f"{a}-{next(iter(m))}" for a, m in CASES])
def test_every_family_generates_for_each_accepted_modality(arch, mm):
    out = llm(arch).generate({"prompt": "Describe it.", "multi_modal_data": mm}, GREEDY)
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
    feature = llm(arch).loaded.spec.feature_token(next(iter(mm)))
    feature_id = llm(arch).loaded.tokenizer.convert_tokens_to_ids(feature)
    assert out[0].prompt_token_ids.count(feature_id) > 1  # the placeholder was expanded


def test_gemma3_pan_and_scan_through_mm_processor_kwargs():
    """Gemma 3's do_pan_and_scan (a request's mm_processor_kwargs): a wide image also gets
    crops, each 16 more image tokens here; the kwargs are part of the cache key."""
    model = llm("gemma3")
    wide = {"prompt": "Describe it.", "multi_modal_data": {"image": img(6, 400, 100)}}
    plain = model.generate(wide, GREEDY)[0]
    crops = model.generate({**wide, "mm_processor_kwargs": {
        "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}}, GREEDY)[0]
    soft = model.loaded.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert plain.prompt_token_ids.count(soft) == 16
    assert crops.prompt_token_ids.count(soft) > 16 and crops.prompt_token_ids.count(soft) % 16 == 0
    assert crops.metrics["item_cache_hits"] == [False]
    assert len(crops.outputs[0].token_ids) == 6


def test_smolvlm_splits_images_unless_told_not_to_and_refuses_images_with_a_video():
    """SmolVLM: a 120x90 image is 3x4 tiles of 16 <image> tokens plus the global view's 16;
    with do_image_splitting off (a request's mm_processor_kwargs) only the global view. Its
    processor puts images and video frames in one tensor, so a prompt with both is a 400
    naming the rule (not a silently dropped image)."""
    model = llm("smolvlm")
    token = model.loaded.tokenizer.convert_tokens_to_ids("<image>")
    one = {"prompt": "Describe it.", "multi_modal_data": {"image": img(1, 120, 90)}}
    split = model.generate(one, GREEDY)[0]
    whole = model.generate({**one, "mm_processor_kwargs": {"do_image_splitting": False}},
                           GREEDY)[0]
    assert split.prompt_token_ids.count(token) == 16 * (3 * 4 + 1)
    assert whole.prompt_token_ids.count(token) == 16
    with pytest.raises(InvalidRequestError) as info:
        model.generate({"prompt": "<image><video> Compare.", "multi_modal_data": {
            "image": img(), "video": frames()}}, GREEDY)
    assert info.value.code == "mixed_modalities_unsupported" and "not both" in info.value.message


def test_qwen3_vl_mixed_prompt_with_video_metadata_batches_like_alone():
    """Qwen3-VL on an image and a video given with its metadata: the prompt carries each
    temporal patch's time from that metadata, and batched with other prompts (left padding,
    M-RoPE positions, deepstack features of two images and a video) the greedy tokens are
    those it gets alone; a cache hit gives them too."""
    model = llm("qwen3_vl")
    meta = {"total_num_frames": 120, "fps": 30.0, "frames_indices": [0, 40, 80, 119]}
    mixed = {"prompt": "Compare them.",
             "multi_modal_data": {"image": img(4), "video": (frames(), meta)}}
    alone = model.generate(mixed, GREEDY)[0]
    text = model.loaded.tokenizer.decode(alone.prompt_token_ids)
    assert re.findall(r"<([0-9.]+) seconds>", text) == ["0.7", "3.3"]  # (80 + 119) / 2 / 30
    batch = model.generate([{"prompt": "Hi"}, mixed,
                            {"prompt": "x", "multi_modal_data": {"image": img(5)}}], GREEDY)
    assert batch[1].metrics["item_cache_hits"] == [True, True]
    assert batch[1].prompt_token_ids == alone.prompt_token_ids
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_cache_hit_gives_the_same_greedy_output():
    model = llm("qwen2_5_vl")
    prompt = {"prompt": "What is shown?", "multi_modal_data": {"image": img(7, 200, 150)}}
    first = model.generate(prompt, GREEDY)[0]
    second = model.generate(prompt, GREEDY)[0]
    assert first.metrics["item_cache_hits"] == [False]
    assert second.metrics["item_cache_hits"] == [True]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert first.prompt_token_ids == second.prompt_token_ids


def test_chat_with_server_content_parts():
    jpeg = synthetic.make_image(120, 90, fmt="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    out = llm("qwen2_5_vl").chat(messages, GREEDY)
    assert len(out[0].outputs[0].token_ids) == 6
    assert "<|vision_start|>" in out[0].prompt
    wav = synthetic.make_audio(seconds=0.5)
    audio = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                "format": "wav"}},
        {"type": "text", "text": "What is said?"}]}]
    out = llm("qwen2_audio").chat(audio, GREEDY)
    assert "Audio 1:" in out[0].prompt and len(out[0].outputs[0].token_ids) == 6


def test_chat_samples_a_video_at_the_kwargs_fps():
    """``mm_processor_kwargs={"fps": N}`` is the frames per second a chat's video is sampled
    at (the server's rule too: test_front_door.py::test_a_requests_video_fps_takes_effect)."""
    clip = synthetic.make_video(width=64, height=48, seconds=2, fps=8)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
    one, eight = (len(llm("qwen2_5_vl").chat(messages, SamplingParams(max_tokens=1), {"fps": fps}
                                             )[0].prompt_token_ids) for fps in (1, 8))
    assert one < eight


def test_chat_refusals():
    model = llm("qwen2_5_vl")
    with pytest.raises(InvalidRequestError, match="does not accept audio"):
        model.chat([{"role": "user", "content": [
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}]}])
    with pytest.raises(InvalidRequestError, match="unsupported type 'image'"):
        model.chat([{"role": "user", "content": [{"type": "image", "image": "x"}]}])
    from engine import LLM

    bare = LLM("tiny:llava")
    with pytest.raises(ConfigError, match="--chat-template"):
        bare.chat([{"role": "user", "content": "hello"}])
    bare.close()


def test_generate_takes_vllms_priority_argument_only_where_it_is_honoured():
    """``LLM.generate(..., priority=[...])`` as vLLM's: one per prompt; under the default
    fcfs scheduling a value other than 0 is refused (vLLM refuses it too), under
    ``scheduling_policy="priority"`` the outputs are those of the same prompts without it."""
    from engine import LLM

    model = llm("qwen2_5_vl")
    prompts = ["Once upon a time", "Hello"]
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        model.generate(prompts, GREEDY, priority=[1, 0])
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        model.generate(prompts, GREEDY, priority=[0])
    plain = [o.outputs[0].token_ids for o in model.generate(prompts, GREEDY, priority=[0, 0])]
    ranked = LLM("tiny:qwen2_5_vl", scheduling_policy="priority")
    try:
        got = ranked.generate(prompts, GREEDY, priority=[5, -1])
        assert [o.outputs[0].token_ids for o in got] == plain
    finally:
        ranked.close()


def test_sampling_seed_stop_and_n():
    model = llm("qwen2_vl")
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=11, n=2,
                            ignore_eos=True)
    a = model.generate("Tell me a story.", params)[0]
    b = model.generate("Tell me a story.", params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids  # n=2 rows sample differently
    greedy = model.generate("Tell me a story.", SamplingParams(max_tokens=8, temperature=0,
                                                                ignore_eos=True))[0].outputs[0]
    stop = greedy.text[2:4] if len(greedy.text) >= 4 else greedy.text[-1:]
    stopped = model.generate("Tell me a story.", SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert greedy.text.startswith(stopped.text)


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0},
                                 {"n": 99}, {"top_k": -5}, {"stop": [""]}, {"seed": "x"}])
def test_sampling_params_validation(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_streaming_and_cancellation():
    model = llm("qwen2_vl")
    processed = model.prepare("Go on.", [], None, raw=True)[1]
    seen: list[int] = []
    stop_after = threading.Event()

    def on_event(event):
        if event.token_id is not None:
            seen.append(event.token_id)
            if len(seen) == 3:
                stop_after.set()

    req = EngineRequest(processed, SamplingParams(max_tokens=2000, temperature=0,
                                                  ignore_eos=True), on_event=on_event)
    model.engine.submit(req)
    assert stop_after.wait(60)
    req.cancel()
    assert req.done.wait(60)
    assert req.outputs[0].finish_reason == "abort"
    assert 3 <= len(req.outputs[0].token_ids) < 2000


def test_concurrent_requests_share_forward_passes():
    model = llm("qwen2_5_vl")
    prepared = [model.prepare(f"Picture {i}.", [], None, raw=True)[1] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = model.engine.batches
    reqs = [model.engine.submit(EngineRequest(p, params)) for p in prepared]
    for r in reqs:
        assert r.done.wait(60)
    assert model.engine.batches - before < 6
    assert max(r.timings["batch_size"] for r in reqs) > 1
    solo = model.engine.submit(EngineRequest(prepared[0], params))
    solo.done.wait(60)
    assert solo.outputs[0].token_ids == reqs[0].outputs[0].token_ids  # batching changes nothing


PREPROCESS_STAGES = ("hash_s", "cache_lookup_s", "media_decode_s", "processor_s")


def timed_generate(model, prompt) -> tuple[dict, float]:
    start = time.perf_counter()
    out = model.generate(prompt, GREEDY)[0]
    return out.metrics, time.perf_counter() - start


def test_stage_timings_are_reported():
    model = llm("qwen2_5_vl")
    image = {"prompt": "x", "multi_modal_data": {"image": img(9)}}
    first, wall = timed_generate(model, image)
    again, _ = timed_generate(model, image)
    text, _ = timed_generate(model, {"prompt": "x"})
    assert first["item_cache_hits"] == [False] and again["item_cache_hits"] == [True]
    # The stages that did work on the first (cache-miss) request took time.
    for key in ("processor_s", "queue_s", "encoder_s", "prefill_s", "first_token_s",
                "decode_s"):
        assert first[key] > 0, key
    # Time to first token is the wait in the queue, the vision encoder and the prefill
    # (each rounded to the microsecond), and the stages are disjoint parts of the call.
    assert first["first_token_s"] == pytest.approx(
        first["queue_s"] + first["encoder_s"] + first["prefill_s"], abs=5e-6)
    assert sum(first[k] for k in PREPROCESS_STAGES) + first["first_token_s"] + \
        first["decode_s"] <= wall
    # Stages that did not run report zero: no decode on a cache hit, no vision encoder (and
    # no media stage at all) for a text-only prompt.
    assert again["media_decode_s"] == 0 and again["encoder_s"] > 0
    assert text["encoder_s"] == 0 and text["item_cache_hits"] == []
    assert text["hash_s"] == text["cache_lookup_s"] == text["media_decode_s"] == 0


@pytest.mark.needs_gpu
def test_cuda_execution_matches_cpu_greedy():
    from engine import LLM

    gpu = LLM("tiny:qwen2_vl", device="cuda", dtype="float32")
    prompt = {"prompt": "Describe.", "multi_modal_data": {"image": img(3)}}
    on_gpu = gpu.generate(prompt, GREEDY)[0].outputs[0].token_ids
    on_cpu = llm("qwen2_vl").generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert on_gpu == on_cpu


def test_a_finished_request_and_its_prompt_are_freed_without_the_garbage_collector():
    """Nothing the engine builds per batch (sampler, stopping rule, streamer, rows) may hold a
    request in a reference cycle: a cycle keeps the request and its media tensors alive until
    the cyclic collector runs, and under steady traffic the engine's heap rose in steps."""
    import gc
    import weakref

    model = llm("qwen2_5_vl")
    params = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.8, top_k=20, seed=3, n=2)
    gc.collect()
    gc.disable()
    try:
        prepared = [model.prepare("<|vision_start|><|image_pad|><|vision_end|>What is it?",
                                  [MediaItem("image", decoded=img(k))], None, False)[1]
                    for k in range(3)]
        prompts = [weakref.ref(p) for p in prepared]  # (the media tensors stay in the cache)
        reqs = [model.engine.submit(EngineRequest(p, params)) for p in prepared]
        for r in reqs:
            assert r.done.wait(60) and r.error is None
            assert all(len(o.token_ids) > 0 for o in r.outputs)
        refs = [weakref.ref(r) for r in reqs] + prompts
        del reqs, r, prepared
        deadline = time.monotonic() + 10  # the engine thread returns from the batch
        while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [ref() for ref in refs] == [None] * 6
    finally:
        gc.enable()
