"""Preprocessing: per-item assembly equals one processor call; the cache; limits; kwargs."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import ConfigError, InvalidRequestError
from engine.processing.cache import ProcessorCache
from engine.processing.kwargs import merge_processor_kwargs
from engine.processing.limits import check_item_counts, effective_limits
from engine.processing.media_items import InProcessDecoders, item_for
from engine.processing.preprocess import MediaItem, Preprocessor, concat
from engine.processing.prompt import insert_placeholders, render_chat
from tests.engine_fixtures import FAMILIES, loaded
from tests.fixtures import synthetic


def image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(synthetic.image_array(w, h, seed))


def sample(arch: str):
    """(messages, items, processor kwargs for one full call) covering each modality."""
    if arch == "qwen2_audio":
        wave = (np.sin(np.arange(16000) / 7) * 0.3).astype(np.float32)
        items = [MediaItem("audio", decoded=(wave, 16000)),
                 MediaItem("audio", decoded=(wave[:6000], 16000))]
        parts = [{"type": "audio"}, {"type": "audio"}]
        full = {"audio": [i.decoded[0] for i in items], "sampling_rate": 16000}
    elif arch == "llava":
        items = [MediaItem("image", decoded=image(80, 60))]
        parts = [{"type": "image"}]
        full = {"images": [items[0].decoded]}
    elif arch == "smolvlm":
        # images or a video, not both: two images split differently (3x4 and 2x4 tiles + the
        # global view), joined along the tiles; its video: test_smolvlm_video_...
        items = [MediaItem("image", decoded=image(120, 90)), MediaItem("image",
                                                                       decoded=image(64, 200, 2))]
        parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
        full = {"images": [[i.decoded for i in items]], "add_special_tokens": False}
    elif arch == "gemma3":
        items = [MediaItem("image", decoded=image(120, 90)), MediaItem("image",
                                                                       decoded=image(64, 200, 2))]
        parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
        # its template writes <bos>: no second one, as apply_chat_template(tokenize=True) does
        full = {"images": [i.decoded for i in items], "add_special_tokens": False}
    else:
        frames = np.stack([synthetic.video_frame(i, 96, 64) for i in range(4)])
        items = [MediaItem("image", decoded=image(120, 90)), MediaItem("video", decoded=frames),
                 MediaItem("image", decoded=image(64, 200, 2))]
        parts = [{"type": "image"}, {"type": "video"}, {"type": "image"}]
        full = {"images": [items[0].decoded, items[2].decoded], "videos": [frames]}
        if loaded(arch).spec.video_timestamps:
            # Timestamps from each clip's metadata: a 4-frame sample of a 1 s 30 fps clip, and
            # an odd 5-frame sample of a 2 s 25 fps one (its last temporal patch is padded).
            odd = np.stack([synthetic.video_frame(i, 64, 96) for i in range(5)])
            metas = [{"total_num_frames": 30, "fps": 30.0, "frames_indices": [0, 10, 19, 29]},
                     {"total_num_frames": 50, "fps": 25.0, "frames_indices": [0, 12, 25, 37, 49]}]
            items[1].metadata = metas[0]
            items.append(MediaItem("video", decoded=odd, metadata=metas[1]))
            parts.append({"type": "video"})
            full.update(videos=[frames, odd], do_sample_frames=False,
                        video_metadata=[dict(m, frames_indices=list(m["frames_indices"]))
                                        for m in metas])
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]
    return messages, items, full


@pytest.mark.parametrize("arch", FAMILIES)
def test_assembled_inputs_equal_one_processor_call(arch):
    lm = loaded(arch)
    messages, items, full = sample(arch)
    text = render_chat(lm, messages)
    got = Preprocessor(lm, ProcessorCache(1 << 30)).process(text, items)
    ref = lm.processor(text=[text], return_tensors="pt", **full)
    assert got.input_ids == ref["input_ids"][0].tolist()
    for key, value in ref.items():
        if key in ("input_ids", "attention_mask"):
            continue
        assert torch.equal(got.mm[key], value), key
    if arch == "qwen3_vl":  # each temporal patch's mean time, from the metadata
        stamps = re.findall(r"<([0-9.]+) seconds>", lm.tokenizer.decode(got.input_ids))
        assert stamps == ["0.2", "0.8", "0.2", "1.2", "2.0"]  # 30 fps: (0+10)/2/30...


def resize_inputs(monkeypatch, cls) -> list[tuple[bool, bool]]:
    """Per call of ``cls.resize`` from now on: (input contiguous, input channels-last)."""
    seen: list[tuple[bool, bool]] = []
    resize = cls.resize

    def spy(self, *args, **kwargs):
        x = args[0] if args else next(kwargs[k] for k in ("image", "images", "videos", "video")
                                      if k in kwargs)
        seen.append((x.is_contiguous(), x.stride()[-3] == 1))
        return resize(self, *args, **kwargs)

    monkeypatch.setattr(cls, "resize", spy)
    return seen


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "qwen2_audio"])
def test_images_are_resized_channels_last_and_equal_the_processor_on_the_pil_image(
        arch, monkeypatch):
    """An RGB image reaches the processor's resize in the layout torch resizes fastest (its
    bytes as PIL holds them: height x width x 3), not copied into a contiguous (3, H, W)
    tensor first; the tensors equal the processor called on the PIL image in a fresh copy
    of the processor (its own path, untouched), and the processor stays picklable."""
    import copy
    import pickle

    lm = loaded(arch)
    pristine = copy.deepcopy(lm.processor)
    pre = Preprocessor(lm, ProcessorCache(0))
    seen = resize_inputs(monkeypatch, type(lm.processor.image_processor))
    img = image(300, 200, 3)
    placeholder = lm.spec.placeholders["image"]
    got = pre.process(f"{placeholder}\nWhat?", [MediaItem("image", decoded=img)])
    assert seen and seen[0] == (False, True), seen  # channels-last, no copy before the resize
    ref = pristine(text=[f"{placeholder}\nWhat?"], images=[img], return_tensors="pt")
    assert got.input_ids == ref["input_ids"][0].tolist()
    for key, value in ref.items():
        if key not in ("input_ids", "attention_mask"):
            assert torch.equal(got.mm[key], value), key
    again = pickle.loads(pickle.dumps(lm.processor))
    assert again.image_processor.process_image.owner is again.image_processor


@pytest.mark.parametrize("arch", [a for a in FAMILIES if "video" in loaded(a).spec.modalities])
def test_video_frames_are_resized_channels_last_and_equal_the_processor_on_the_array(
        arch, monkeypatch):
    """A decoded clip ((frames, H, W, 3) uint8, as the decoders give it) reaches the video
    processor's resize as a channels-last view of its memory, not a contiguous copy; the
    tensors and prompt equal a fresh copy of the processor called on the same array."""
    import copy

    lm = loaded(arch)
    pristine = copy.deepcopy(lm.processor)
    pre = Preprocessor(lm, ProcessorCache(0))
    seen = resize_inputs(monkeypatch, type(lm.processor.video_processor))
    frames = np.stack([synthetic.video_frame(i, 96, 64) for i in range(4)])
    meta = {"total_num_frames": 30, "fps": 30.0, "frames_indices": [0, 10, 19, 29]}
    prompt = f"{lm.spec.placeholders['video']}\nWhat?"
    got = pre.process(prompt, [MediaItem("video", decoded=frames, metadata=dict(meta))])
    assert seen and seen[0] == (False, True), seen
    ref = pristine(text=[prompt], videos=[frames], return_tensors="pt", do_sample_frames=False,
                   video_metadata=[copy.deepcopy(meta)])
    assert got.input_ids == ref["input_ids"][0].tolist()
    for key, value in ref.items():
        if key not in ("input_ids", "attention_mask"):
            assert torch.equal(got.mm[key], value), key


def test_smolvlm_video_with_its_metadata_assembles_like_one_call():
    """SmolVLM's video prompt: an intro with the frame count in words and the clip's length,
    then each frame's mm:ss timestamp (from the metadata the engine keeps of its sample) and
    its tile; text around it, so it is assembled as text."""
    lm = loaded("smolvlm")
    frames = np.stack([synthetic.video_frame(i, 96, 64) for i in range(4)])
    meta = {"total_num_frames": 150, "fps": 30.0, "frames_indices": [0, 49, 99, 149]}
    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": "What?"}]}]
    text = render_chat(lm, messages)
    got = Preprocessor(lm, ProcessorCache(1 << 30)).process(
        text, [MediaItem("video", decoded=frames, metadata=dict(meta))])
    ref = lm.processor(text=[text], videos=[frames], video_metadata=[dict(meta)],
                       do_sample_frames=False, add_special_tokens=False, return_tensors="pt")
    assert got.input_ids == ref["input_ids"][0].tolist()
    for key in ("pixel_values", "pixel_attention_mask"):
        assert torch.equal(got.mm[key], ref[key]), key
    prompt = lm.tokenizer.decode(got.input_ids)
    assert "series of four frames from a 0:00:04" in prompt  # 149 / 30 s, truncated
    assert re.findall(r"Frame from (\d\d:\d\d)", prompt) == ["00:00", "00:01", "00:03", "00:04"]


def test_gemma3_pan_and_scan_crops_assemble_like_one_call():
    """Gemma 3 with pan-and-scan: a wide image gets crops, each its own pixel_values row and
    image tokens inside "Here is the original image ... and here are some crops" text; a small
    one none. The assembled prompt (as text: the expansions meet the prompt's newlines) equals
    one processor call with the same kwargs, and the kwargs are part of the cache key."""
    lm = loaded("gemma3")
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
    items = [MediaItem("image", decoded=image(400, 100)), MediaItem("image",
                                                                    decoded=image(60, 50, 1))]
    text = render_chat(lm, [{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "What?"}]}])
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    got = pre.process(text, items, kwargs)
    ref = lm.processor(text=[text], images=[i.decoded for i in items], return_tensors="pt",
                       add_special_tokens=False, **kwargs)
    assert got.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(got.mm["pixel_values"], ref["pixel_values"])
    assert torch.equal(got.mm["token_type_ids"], ref["token_type_ids"])
    assert got.mm["pixel_values"].shape[0] > 2  # the wide image's crops
    assert "here are some crops" in lm.tokenizer.decode(got.input_ids)
    plain = pre.process(text, items)
    assert plain.item_hits == [False, False] and plain.mm["pixel_values"].shape[0] == 2


def test_cache_hit_gives_the_same_inputs_and_skips_decoding_and_processing():
    lm = loaded("qwen2_5_vl")
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    calls = Counter()
    real = pre.process_item

    def counting(item, data, kwargs):
        calls["processor"] += 1
        return real(item, data, kwargs)

    pre.process_item = counting
    jpeg = synthetic.make_image(320, 240, fmt="JPEG", seed=3)

    def item() -> MediaItem:
        def decode():
            calls["decode"] += 1
            from engine.config import MediaLimits
            from engine.media.image import decode_image

            return decode_image(jpeg, MediaLimits.from_env())
        return MediaItem("image", encoded=jpeg, decode=decode)

    prompt = render_chat(lm, [{"role": "user", "content": [{"type": "image"},
                                                           {"type": "text", "text": "Hi"}]}])
    miss = pre.process(prompt, [item()])
    hit = pre.process(prompt, [item()])
    assert miss.item_hits == [False] and hit.item_hits == [True]
    assert calls == {"processor": 1, "decode": 1}
    assert hit.input_ids == miss.input_ids
    assert all(torch.equal(hit.mm[k], miss.mm[k]) for k in miss.mm)
    assert pre.cache.stats.hits == 1 and pre.cache.stats.misses == 1


def test_different_kwargs_never_share_an_entry():
    lm = loaded("qwen2_5_vl")
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    jpeg = synthetic.make_image(640, 480, fmt="JPEG", seed=4)
    prompt = lm.spec.placeholders["image"] + "Hi"
    from engine.config import MediaLimits
    from engine.media.image import decode_image

    def item() -> MediaItem:
        return MediaItem("image", encoded=jpeg,
                         decode=lambda: decode_image(jpeg, MediaLimits.from_env()))

    small = pre.process(prompt, [item()], {"max_pixels": 28 * 28 * 16})
    large = pre.process(prompt, [item()], {"max_pixels": 28 * 28 * 64})
    again = pre.process(prompt, [item()], {"max_pixels": 28 * 28 * 16})
    assert small.item_hits == [False] and large.item_hits == [False] and again.item_hits == [True]
    assert len(small.input_ids) < len(large.input_ids)


class RecordingDecoders(InProcessDecoders):
    """The in-process decoders, recording which backend each video decode used."""

    def __init__(self) -> None:
        super().__init__()
        self.video_backends: list[str] = []

    def decode_video(self, data, spec, limits):
        self.video_backends.append(spec.backend)
        return super().decode_video(data, spec, limits)


def video_through_cache(pre: Preprocessor, clip: bytes, request: dict | None,
                        decoders: RecordingDecoders | None = None):
    """One video request as the server builds it: the request's media_io_kwargs.video merged
    over the server's spec, the item made by the production ``item_for``, then the cache."""
    from engine.config import MediaLimits
    from engine.media.video.options import parse_video_io_kwargs, server_video_spec

    spec = parse_video_io_kwargs(request, server_video_spec({"video": {"backend": "pyav"}}))
    item = item_for("video", clip, MediaLimits.from_env(), spec, 16_000, decoders)
    return pre.process(pre.loaded.spec.placeholders["video"] + "Hi", [item])


def test_qwen3_vl_fetched_video_timestamps_come_from_the_clip_and_survive_the_cache():
    """Qwen3-VL writes each temporal patch's time into the prompt. For a fetched clip they come
    from its fps and the sampled frame indices (not the processor's 24 fps default), equal one
    processor call given the decoded frames and their metadata, and a cache hit (which decodes
    nothing) gives the same ids."""
    from engine.config import MediaLimits
    from engine.media.video.options import parse_video_io_kwargs, server_video_spec
    from engine.processing.media_items import hf_video_metadata

    lm = loaded("qwen3_vl")
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    clip = synthetic.make_video(width=96, height=64, fps=8, seconds=2)  # 16 frames
    decoders = RecordingDecoders()
    miss = video_through_cache(pre, clip, {"num_frames": 4}, decoders)
    hit = video_through_cache(pre, clip, {"num_frames": 4}, decoders)
    assert (miss.item_hits, hit.item_hits) == ([False], [True])
    assert len(decoders.video_backends) == 1
    assert hit.input_ids == miss.input_ids
    spec = parse_video_io_kwargs({"num_frames": 4},
                                 server_video_spec({"video": {"backend": "pyav"}}))
    video = InProcessDecoders().decode_video(clip, spec, MediaLimits.from_env())
    assert video.metadata.sampled_indices == [0, 5, 10, 15]
    ref = lm.processor(text=[lm.spec.placeholders["video"] + "Hi"], videos=[video.frames],
                       video_metadata=[hf_video_metadata(video.metadata)], do_sample_frames=False,
                       return_tensors="pt")
    assert miss.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(miss.mm["pixel_values_videos"], ref["pixel_values_videos"])
    # (0 + 5) / 2 / 8 fps and (10 + 15) / 2 / 8 fps
    assert re.findall(r"<([0-9.]+) seconds>", lm.tokenizer.decode(miss.input_ids)) == ["0.3", "1.6"]


# A 2 s clip at 8 fps (16 frames): each pair below differs in one sampling option, and the two
# settings pick different numbers of frames (see engine/media/video/sampling.py).
SAMPLING_PAIRS = {
    "num_frames": ({"num_frames": 4}, {"num_frames": 8}),                   # 4 vs 8 frames
    "fps": ({"num_frames": 8, "fps": 1}, {"num_frames": 8, "fps": 2}),      # 2 vs 4 frames
    "max_duration": ({"fps": 2, "max_duration": 1}, {"fps": 2, "max_duration": 2}),  # 2 vs 4
}


@pytest.mark.parametrize("option", SAMPLING_PAIRS)
def test_video_sampling_options_never_share_an_entry(option):
    """The same video bytes with a different num_frames / fps / max_duration are a cache miss
    and give the other frame count's tokens and pixel values; the first setting again is a
    hit (so video items are cached, and the key is stable)."""
    lm = loaded("qwen2_5_vl")
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    clip = synthetic.make_video(width=96, height=64, fps=8, seconds=2)
    first_kwargs, second_kwargs = SAMPLING_PAIRS[option]
    first = video_through_cache(pre, clip, first_kwargs)
    second = video_through_cache(pre, clip, second_kwargs)
    again = video_through_cache(pre, clip, first_kwargs)
    assert (first.item_hits, second.item_hits, again.item_hits) == ([False], [False], [True])
    # Twice the frames: twice the temporal patches, so more video tokens and pixel rows.
    assert len(second.input_ids) > len(first.input_ids)
    assert second.mm["pixel_values_videos"].shape[0] == \
        2 * first.mm["pixel_values_videos"].shape[0]
    assert again.input_ids == first.input_ids
    assert torch.equal(again.mm["pixel_values_videos"], first.mm["pixel_values_videos"])


@pytest.mark.parametrize("first_kwargs, second_kwargs", [
    ({"backend": "pyav"}, {"backend": "opencv"}),
    ({"backend": "pyav", "threads": 1}, {"backend": "pyav", "threads": 2}),
], ids=["backend", "backend_options"])
def test_video_backends_and_their_options_never_share_an_entry(first_kwargs, second_kwargs):
    """Every backend is meant to return the same frames for the same clip and request
    (engine/media/video/__init__.py; tests/media/test_video_exact.py checks it), and pyav's thread
    count does not change frames either, so the processed outputs cannot tell the two entries
    apart. What this checks instead: the second setting is a cache miss whose decode really
    ran (with its own backend), rather than being served what another backend or option
    decoded; a backend that differs on some clip (a bug, or torchcodec's approximate seeking)
    must never have its frames served for another. The first setting again is a hit that
    decodes nothing."""
    lm = loaded("qwen2_5_vl")
    pre = Preprocessor(lm, ProcessorCache(1 << 30))
    clip = synthetic.make_video(width=96, height=64, fps=8, seconds=2)
    decoders = RecordingDecoders()
    first = video_through_cache(pre, clip, {**first_kwargs, "num_frames": 4}, decoders)
    second = video_through_cache(pre, clip, {**second_kwargs, "num_frames": 4}, decoders)
    again = video_through_cache(pre, clip, {**first_kwargs, "num_frames": 4}, decoders)
    assert (first.item_hits, second.item_hits, again.item_hits) == ([False], [False], [True])
    assert decoders.video_backends == [first_kwargs["backend"], second_kwargs["backend"]]
    assert pre.cache.stats.entries == 2


def test_byte_bound_evicts_least_recently_used():
    cache = ProcessorCache(100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("c", "C", 40)       # over 100 bytes: b (least recent) goes
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.stats.evictions == 1 and cache.stats.bytes == 80
    cache.put("huge", "H", 1000)  # larger than the whole cache: not stored
    assert cache.get("huge") is None
    disabled = ProcessorCache.from_gb(0)
    disabled.put("a", "A", 1)
    assert not disabled.enabled and disabled.get("a") is None


def test_effective_limits_and_errors():
    spec = loaded("qwen2_5_vl").spec
    limits = effective_limits(spec, {"image": 2})
    assert limits == {"image": 2, "video": 8, "audio": 0}
    with pytest.raises(InvalidRequestError) as info:
        check_item_counts({"image": 3}, limits, spec, {"image": 2})
    assert "--limit-mm-per-prompt" in info.value.hint and "image" in info.value.message
    big = effective_limits(spec, {"video": 100})
    with pytest.raises(InvalidRequestError) as info:
        check_item_counts({"video": 9}, big, spec, {"video": 100})
    assert "model's own maximum is 8" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        check_item_counts({"audio": 1}, limits, spec, None)
    assert info.value.code == "modality_not_supported"
    with pytest.raises(ConfigError):
        effective_limits(spec, {"smell": 1})


def test_processor_kwargs_merge_and_validation():
    processor = loaded("qwen2_5_vl").processor
    merged = merge_processor_kwargs(processor, {"max_pixels": 100_000, "min_pixels": 3136},
                                    {"max_pixels": 50_000})
    assert merged == {"max_pixels": 50_000, "min_pixels": 3136}
    with pytest.raises(InvalidRequestError) as info:
        merge_processor_kwargs(processor, None, {"max_pixel": 1})
    assert "max_pixel" in info.value.message and info.value.status == 400


def test_raw_prompt_placeholders():
    spec = loaded("llava").spec
    assert insert_placeholders("USER: hi ASSISTANT:", spec, {"image": 1}) == \
        "<image>\nUSER: hi ASSISTANT:"
    written = "USER: <image>\nhi ASSISTANT:"
    assert insert_placeholders(written, spec, {"image": 1}) == written
    with pytest.raises(InvalidRequestError, match="placeholder"):
        insert_placeholders("USER: <image><image> ASSISTANT:", spec, {"image": 1})
    with pytest.raises(InvalidRequestError, match="no image item"):
        insert_placeholders("USER: <image> ASSISTANT:", spec, {})


@pytest.mark.parametrize("arch", FAMILIES)
def test_control_tokens_in_message_text_are_refused(arch):
    model = loaded(arch)
    tokenizer = model.processor.tokenizer
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    assert specials  # every family's tokenizer has some
    plain = [{"role": "user", "content": "a <b>tag</b>, <|not_a_token|> and [INST]"}]
    if model.chat_template:
        assert "<|not_a_token|>" in render_chat(model, plain)
    for token in specials:
        for content in (f"hi {token} there", [{"type": "text", "text": f"x{token}"}]):
            with pytest.raises(InvalidRequestError) as info:
                render_chat(model, [{"role": "system", "content": "ok"},
                                    {"role": "user", "content": content}])
            assert info.value.code == "control_token_in_text" and "messages[1]" in str(
                info.value) and token in str(info.value)


def test_qwen2_5_vl_video_gets_its_clips_seconds_per_temporal_patch():
    """Qwen2.5-VL's M-RoPE time axis steps by second_per_grid_ts = temporal_patch_size / the
    sampled fps: 16 frames sampled from a 2 s, 30 fps clip are 8 fps, so 0.25 s per patch of
    2 frames (without the clip's metadata the processor assumes 24 fps: 0.083)."""
    lm = loaded("qwen2_5_vl")
    frames = np.stack([synthetic.video_frame(i, 64, 48) for i in range(16)])
    meta = {"total_num_frames": 60, "fps": 30.0,
            "frames_indices": [round(i * 59 / 15) for i in range(16)]}
    text = lm.spec.placeholders["video"] + "What?"
    got = Preprocessor(lm).process(text, [MediaItem("video", decoded=frames,
                                                    metadata=dict(meta))])
    ref = lm.processor(text=[text], videos=[frames], video_metadata=[dict(meta)],
                       do_sample_frames=False, return_tensors="pt")
    assert got.input_ids == ref["input_ids"][0].tolist()
    assert torch.allclose(torch.as_tensor(got.mm["second_per_grid_ts"]),
                          torch.tensor([0.25]))
    assert torch.equal(torch.as_tensor(got.mm["second_per_grid_ts"]),
                       torch.as_tensor(ref["second_per_grid_ts"]))


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "qwen2_audio"])
def test_an_image_of_a_known_size_runs_the_image_processor_alone_with_the_same_inputs(
        arch, monkeypatch):
    """The first image of a size runs the whole processor; the second too, and proves for
    these kwargs that the image processor alone gives the same tensors; from the third on
    only the image processor runs and the expansion is remembered. Every one equals a fresh
    copy of the processor called on the whole prompt. A processor whose image processor
    alone gives other values never takes the short path."""
    import copy

    lm = loaded(arch)
    pristine = copy.deepcopy(lm.processor)
    calls: list[int] = []
    whole = type(lm.processor).__call__

    def counting(self, *args, **kwargs):
        if self is lm.processor:
            calls.append(1)
        return whole(self, *args, **kwargs)

    monkeypatch.setattr(type(lm.processor), "__call__", counting)
    prompt = f"{lm.spec.placeholders['image']}\nWhat?"

    def check(pre: Preprocessor, img) -> None:
        got = pre.process(prompt, [MediaItem("image", decoded=img)])
        ref = pristine(text=[prompt], images=[img], return_tensors="pt")
        assert got.input_ids == ref["input_ids"][0].tolist()
        for key, value in ref.items():
            if key not in ("input_ids", "attention_mask"):
                assert torch.equal(got.mm[key], value), key

    pre = Preprocessor(lm, ProcessorCache(0))
    for seed in range(4):
        check(pre, image(300, 200, seed))
    assert len(calls) == 2 and all(pre.shapes.proven.values()) and pre.shapes.proven
    check(pre, image(200, 300, 9))  # a new size: the whole processor, once
    assert len(calls) == 3
    calls.clear()
    other = Preprocessor(lm, ProcessorCache(0))
    run = other.shapes.run
    monkeypatch.setattr(other.shapes, "run", lambda *args: {  # other pixels than the whole's
        k: torch.zeros_like(v) if k == "pixel_values" else v for k, v in run(*args).items()})
    for seed in range(4):
        check(other, image(300, 200, seed))
    assert len(calls) == 4 and list(other.shapes.proven.values()) == [None]


def test_concat_of_one_item_hands_its_tensor_over_and_of_several_pads_and_joins():
    one = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert concat([one]) is one  # a prefill of one video would copy its patches for nothing
    tiles = [torch.ones(1, 2, 3), torch.full((2, 3, 3), 2.0)]
    joined = concat(tiles, padded=True)
    assert joined.shape == (3, 3, 3)
    assert torch.equal(joined[0, :2], torch.ones(2, 3)) and not joined[0, 2].any()
    assert torch.equal(joined[1:], tiles[1])
