"""The stage names of one request's timings, defined once, in request order: the
preprocessor fills its own, the engine its own, the server adds the fetch; the response's
``x-aphrodite-timings``, the per-stage histograms on /metrics and every benchmark and report
read them from here."""

from __future__ import annotations

#: the preprocessor's (:meth:`engine.processing.preprocess.Preprocessor.process`)
PREPROCESS_STAGES = ("hash_s", "cache_lookup_s", "media_decode_s", "processor_s")
#: the engine's: waiting for a place in the batch, the encoder, the prompt's forward pass,
#: the generation
ENGINE_STAGES = ("queue_s", "encoder_s", "prefill_s", "decode_s")
#: what a served request reports and ``bench serve``, its report and /metrics show
SERVED_STAGES = ("fetch_s", "media_decode_s", "processor_s", *ENGINE_STAGES)
#: what ``bench mm-processor`` times offline: preprocessing as served, then the encoder
PREPROCESSING_STAGES = ("fetch_s", *PREPROCESS_STAGES, "encoder_s")


def zero_preprocess_timings() -> dict[str, float]:
    return dict.fromkeys(PREPROCESS_STAGES, 0.0)
