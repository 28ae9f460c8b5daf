"""Pixels normalized on the model's device (vLLM's --mm-device-do-normalize, on by default for
Qwen2/2.5/3-VL): the processor's patches stay uint8, the engine's normalization gives the very
floats the processor gives, and generation is the same with it on or off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine.config import PipelineConfig
from engine.executor.sampling import SamplingParams
from engine.processing import device_normalize
from engine.processing.pipeline import Pipeline
from engine.processing.preprocess import MediaItem
from tests.engine_fixtures import loaded
from tests.fixtures import synthetic


def items() -> list[MediaItem]:
    frames = np.stack([synthetic.video_frame(i, 96, 64) for i in range(4)])
    return [MediaItem("image", decoded=synthetic.image_array(120, 90, 3)),
            MediaItem("video", decoded=frames)]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_engines_normalization_gives_the_processors_floats_bit_for_bit(arch):
    lm = loaded(arch)
    prompt = (f"{lm.spec.placeholders['image']}{lm.spec.placeholders['video']}What?")
    deferred = Pipeline(lm, PipelineConfig()).preprocessor
    on_host = Pipeline(lm, PipelineConfig(mm_device_do_normalize=False)).preprocessor
    kwargs = device_normalize.processor_kwargs()
    raw = deferred.process(prompt, items(), kwargs)
    ref = on_host.process(prompt, items(), {})
    assert raw.input_ids == ref.input_ids
    for key in ("pixel_values", "pixel_values_videos"):
        assert raw.mm[key].dtype == torch.uint8 and ref.mm[key].dtype == torch.float32
        assert raw.mm[key].nbytes * 4 == ref.mm[key].nbytes  # a quarter through cache and IPC
    done = device_normalize.apply(raw.mm, device_normalize.normalizers(lm))
    for key, value in ref.mm.items():
        assert torch.equal(done[key], value), key
    assert device_normalize.normalizers(loaded("llava")) == {}  # families without: nothing


def test_generation_is_the_same_on_or_off_and_a_request_cannot_turn_it_back():
    from engine import LLM

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|><|vision_start|>"
                        "<|video_pad|><|vision_end|>What?",
              "multi_modal_data": {"image": Image.fromarray(items()[0].decoded),
                                   "video": items()[1].decoded}}
    runs = []
    for on in (True, False):
        model = LLM("tiny:qwen2_5_vl", mm_device_do_normalize=on, mm_processor_cache_gb=0)
        runs.append(model.generate(prompt, params)[0].outputs[0])
        if on:
            assert model.pipeline.kwargs_for({"do_normalize": True})["do_normalize"] is False
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].logprobs == runs[1].logprobs
