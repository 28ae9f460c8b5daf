"""The lean decode step (engine.models.lean_decode) on real tiny models: for every family it
runs, a decode step's logits equal the model's own forward bit for bit, over rows of
different lengths whose cache was merged and left-padded; families it does not run, and
APHRODITE_LEAN_DECODE=0, get the model's forward."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.executor import kv
from engine.executor.outputs import finish_row
from engine.executor.request import CompletionOutput, EngineRequest
from engine.executor.row import Row
from engine.executor.runner import TransformersRunner
from engine.models import lean_decode, parts
from tests.engine.test_scheduler import greedy, prompts_of
from tests.engine_fixtures import FAMILIES, llm

#: the families whose text model is a plain pre-norm decoder (Gemma 3 and Qwen3-VL are not)
LEAN = ("qwen2_5_vl", "qwen2_vl", "llava", "qwen2_audio", "llava_onevision", "internvl", "smolvlm")


def running_batch(runner: TransformersRunner, prompts: list, params=None) -> object:
    """``prompts`` prefilled one by one and joined into one batch (``params``: each
    request's sampling, 8 greedy tokens by default)."""
    batch = None
    for prompt in prompts:
        req = EngineRequest(prompt, greedy(8) if params is None else params)
        req.outputs = [CompletionOutput(0)]
        part = runner.prefill([Row(req, 0, None)])
        if batch is None:
            batch = part
        else:
            batch.join(part)
    return batch


def one_step_logits(runner: TransformersRunner, batch, lean: bool):
    """A decode step's logits, the cache left as it was."""
    rows = batch.rows
    ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long)
    mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)
    positions = torch.tensor([[r.position] for r in rows], dtype=torch.long)
    if batch.mrope:
        deltas = torch.tensor([[r.rope_delta] for r in rows], dtype=torch.long)
        positions = (positions + deltas).unsqueeze(0).expand(3, -1, -1)
    kv.reserve(batch.cache)
    before = kv.snapshot(batch.cache)
    try:
        with torch.inference_mode():
            if lean:
                return runner._lean_decode(ids, mask, positions, batch.cache)
            return runner.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                use_cache=True, **{runner._cache_arg: batch.cache}
                                ).logits[:, -1, :]
    finally:
        kv.restore(batch.cache, before)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_lean_decode_step_gives_the_models_own_logits_bit_for_bit(arch):
    model = llm(arch)
    runner = model.engine.runner
    if arch not in LEAN:
        assert runner._lean_decode is None  # its layers are not the plain decoder
        return
    assert runner._lean_decode is not None
    batch = running_batch(runner, prompts_of(arch))  # rows of very different lengths
    assert len(batch.rows) >= 3 and not bool(batch.mask.all())  # (padding in the frame)
    lean = one_step_logits(runner, batch, lean=True)
    own = one_step_logits(runner, batch, lean=False)
    assert torch.equal(lean, own)
    for row in batch.rows:
        finish_row(row, "abort")


def test_the_lean_step_is_off_where_it_does_not_apply(monkeypatch):
    runner = llm("qwen2_5_vl").engine.runner
    assert lean_decode.for_model(runner.model) is not None
    monkeypatch.setenv("APHRODITE_LEAN_DECODE", "0")
    assert lean_decode.for_model(runner.model) is None
    monkeypatch.delenv("APHRODITE_LEAN_DECODE")
    text = parts.language_model(runner.model)
    monkeypatch.setattr(text.config, "_attn_implementation", "eager")  # (not our attention)
    assert lean_decode.for_model(runner.model) is None
    monkeypatch.setattr(text.config, "_attn_implementation", "aphrodite_sdpa")
    monkeypatch.setattr(text.config, "layer_types",
                        ["sliding_attention"] * len(text.config.layer_types))
    assert lean_decode.for_model(runner.model) is None


def test_an_engine_decoding_lean_keeps_every_rows_generate_logits():
    from engine.executor.engine import Engine
    from tests.engine.test_scheduler import assert_generate_logits, record_logits

    model = llm("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_seqs=8))
    try:
        assert engine.runner._lean_decode is not None
        logits = record_logits(engine)
        prompts = prompts_of("qwen2_5_vl")
        reqs = [engine.submit(EngineRequest(p, greedy(6))) for p in prompts]
        for req in reqs:
            assert req.done.wait(120) and req.error is None, req.error
        for req, prompt in zip(reqs, prompts, strict=True):
            assert_generate_logits(engine, logits, req, prompt, 6)
    finally:
        engine.close()


def test_fused_products_share_the_layers_weights_and_stay_within_rounding(monkeypatch):
    """Each layer's q/k/v products run as one product and its gate/up products as one, over
    weights concatenated at load: the layers' own weights become views of them (nothing held
    twice). Through PyTorch's product the logits are bit for bit the model's (above); through
    oneDNN's packed kernel (every weight packed here) the sums run in another order, so the
    logits may differ by rounding: bounded here, the greedy tokens the same."""
    runner = llm("qwen2_5_vl").engine.runner
    text = parts.language_model(runner.model)
    head = runner.model.get_output_embeddings()
    monkeypatch.setenv("APHRODITE_LEAN_DECODE_FUSED", "0")
    plain = lean_decode._step(text, list(text.layers), head)
    monkeypatch.setenv("APHRODITE_LEAN_DECODE_FUSED", "1")
    monkeypatch.setenv("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", "0")
    fused = lean_decode._step(text, list(text.layers), head)
    for layer in text.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
        assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        assert up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()
    batch = running_batch(runner, prompts_of("qwen2_5_vl"))
    assert len(batch.rows) >= 4  # (oneDNN takes 4 rows or more)
    monkeypatch.setattr(runner, "_lean_decode", plain)
    want = one_step_logits(runner, batch, lean=True)
    monkeypatch.setattr(runner, "_lean_decode", fused)
    got = one_step_logits(runner, batch, lean=True)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for row in batch.rows:
        finish_row(row, "abort")
