"""The one request pipeline the server, the offline LLM, bench mm-processor and the start-up
check share: built from one frozen config, its stages in order, each setting checked once."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from aphrodite_cli.bench import synthetic
from engine.errors import ConfigError, InvalidRequestError
from engine.processing.pipeline import Pipeline, PipelineConfig
from engine.processing.preprocess import MediaItem
from engine.server.config import ServerConfig
from tests.engine_fixtures import llm, loaded


def test_the_servers_config_gives_a_bounded_picklable_pipeline_config():
    server = ServerConfig(model="tiny:qwen2_5_vl", allowed_media_domains=("example.com",),
                          limit_mm_per_prompt={"image": 2}, mm_processor_kwargs={"fps": 1.0})
    config = server.pipeline_config()
    assert pickle.loads(pickle.dumps(config)) == config  # crosses to the start-up check
    assert config.request_kwargs == "bounded" and config.limit_mm_per_prompt == {"image": 2}
    pipeline = Pipeline(loaded("qwen2_5_vl"), config)
    assert pipeline.limits["image"] == 2 and pipeline.limits["audio"] == 0
    assert pipeline.policy.allowed_domains == frozenset({"example.com"})
    with pytest.raises(InvalidRequestError) as info:  # over the server's own limit
        pipeline.check_counts(Counter(image=3))
    assert "--limit-mm-per-prompt" in str(info.value)


def test_request_kwargs_are_bounded_for_a_server_and_free_for_the_offline_llm():
    """A client of a server may only lower the pixel budget or set fps; the offline caller
    (the operator) may set any key the processor takes. Unknown keys fail both ways."""
    lm = loaded("qwen2_5_vl")
    served = Pipeline(lm, PipelineConfig(request_kwargs="bounded"))
    offline = Pipeline(lm, PipelineConfig())
    with pytest.raises(InvalidRequestError) as info:
        served.kwargs_for({"do_resize": False})
    assert "do_resize" in str(info.value)
    assert offline.kwargs_for({"do_resize": False}) == {"do_resize": False}
    assert served.kwargs_for({"max_pixels": 50_000}) == {"max_pixels": 50_000}
    with pytest.raises(InvalidRequestError, match="cannot be set per request"):
        served.kwargs_for({"no_such_key": 1})
    with pytest.raises(InvalidRequestError, match="not accepted"):
        offline.kwargs_for({"no_such_key": 1})


def test_a_bad_setting_fails_when_the_pipeline_is_built():
    lm = loaded("qwen2_5_vl")
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt"):
        Pipeline(lm, PipelineConfig(limit_mm_per_prompt={"smell": 1}))
    with pytest.raises(ConfigError, match="--allowed-local-media-path"):
        Pipeline(lm, PipelineConfig(allowed_local_media_path="/no/such/folder"))
    with pytest.raises(ConfigError):
        Pipeline(lm, PipelineConfig(media_io_kwargs={"video": {"backend": "nope"}}))


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
