"""The one request pipeline the server, the offline LLM, bench mm-processor and the start-up
check share: built from one frozen config, its stages in order, each setting checked once."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from engine.config import MediaPolicy, PipelineConfig
from engine.errors import ConfigError, InvalidRequestError
from engine.media.video.options import PyAVOptions
from engine.processing.pipeline import Pipeline, pipeline_config
from engine.processing.preprocess import MediaItem
from engine.server.config import ServerConfig
from tests.engine_fixtures import llm, loaded
from tests.fixtures import synthetic


def test_the_flags_become_typed_objects_once_and_cross_processes_as_they_are():
    """What ``serve`` builds from its flags: the policy and the video options are checked,
    typed objects, and the whole config pickles (to the start-up check and API servers)
    unchanged; the pipeline uses those objects, it does not parse them again."""
    config = pipeline_config(
        allowed_media_domains=("Example.COM.",), limit_mm_per_prompt={"image": 2},
        mm_processor_kwargs={"fps": 1.0}, request_kwargs="bounded",
        media_io_kwargs={"video": {"backend": "pyav", "threads": 2, "num_frames": 8}})
    assert config.policy == MediaPolicy.create(allowed_domains=["example.com"])
    assert config.video.options == PyAVOptions(threads=2) and config.video.sampling.num_frames == 8
    server = ServerConfig(model="tiny:qwen2_5_vl", pipeline=config)
    assert pickle.loads(pickle.dumps(server)) == server
    assert ServerConfig().pipeline.request_kwargs == "bounded"  # a server's default
    pipeline = Pipeline(loaded("qwen2_5_vl"), config)
    assert pipeline.policy is config.policy and pipeline.video is config.video
    assert pipeline.limits["image"] == 2 and pipeline.limits["audio"] == 0
    assert pipeline.policy.allowed_domains == frozenset({"example.com"})
    with pytest.raises(InvalidRequestError) as info:  # over the server's own limit
        pipeline.check_counts(Counter(image=3))
    assert "--limit-mm-per-prompt" in str(info.value)


def test_request_kwargs_are_bounded_for_a_server_and_free_for_the_offline_llm():
    """A client of a server may only lower the pixel budget or set fps; the offline caller
    (the operator) may set any key the processor takes. Unknown keys fail both ways."""
    lm = loaded("qwen2_5_vl")
    # (pixels normalized in the processor: the kwargs are the request's and nothing else)
    served = Pipeline(lm, PipelineConfig(request_kwargs="bounded", mm_device_do_normalize=False))
    offline = Pipeline(lm, PipelineConfig(mm_device_do_normalize=False))
    with pytest.raises(InvalidRequestError) as info:
        served.kwargs_for({"do_resize": False})
    assert "do_resize" in str(info.value)
    assert offline.kwargs_for({"do_resize": False}) == {"do_resize": False}
    assert served.kwargs_for({"max_pixels": 50_000}) == {"max_pixels": 50_000}
    with pytest.raises(InvalidRequestError, match="cannot be set per request"):
        served.kwargs_for({"no_such_key": 1})
    with pytest.raises(InvalidRequestError, match="not accepted"):
        offline.kwargs_for({"no_such_key": 1})


def test_a_bad_setting_fails_where_it_enters_and_what_needs_the_model_when_built():
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt"):
        pipeline_config(limit_mm_per_prompt={"smell": 1})
    with pytest.raises(ConfigError, match="--allowed-local-media-path"):
        pipeline_config(allowed_local_media_path="/no/such/folder")
    with pytest.raises(ConfigError, match="unknown video backend"):
        pipeline_config(media_io_kwargs={"video": {"backend": "nope"}})
    with pytest.raises(ConfigError, match="mm_processor_kwargs"):  # needs the processor
        Pipeline(loaded("qwen2_5_vl"), pipeline_config(mm_processor_kwargs={"bogus": 1}))


def test_audio_is_decoded_at_the_models_own_rate():
    """The rate comes from the model's feature extractor, not a constant: bench mm-processor
    and the server decode audio to what the processor expects."""
    lm = loaded("qwen2_audio")
    assert Pipeline(lm).sampling_rate == lm.processor.feature_extractor.sampling_rate
    assert Pipeline(loaded("qwen2_5_vl")).sampling_rate == 16_000  # no extractor: the default


def test_the_offline_llm_prepares_through_the_same_pipeline():
    model = llm("qwen2_5_vl")
    image = Image.fromarray(synthetic.image_array(64, 48, 3))
    text, processed = model.pipeline.prepare("Describe it.", [MediaItem("image", decoded=image)],
                                             raw=True)
    assert text.startswith(model.loaded.spec.placeholders["image"])
    out = model.generate({"prompt": "Describe it.", "multi_modal_data": {"image": image}})
    assert out[0].prompt_token_ids == processed.input_ids
    assert np.isfinite(processed.timings["processor_s"])
