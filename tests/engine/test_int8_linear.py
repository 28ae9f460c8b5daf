"""Weight-only int8 (``--quantization int8``, engine.models.int8_linear): each weight row is
int8 with one scale, off by at most half a scale per element; the product matches a float
product over the dequantized weight within bfloat16 rounding, through the int8 kernel (a
decode step's few rows) and the bfloat16 path (a prefill's many); the tiny model quantized
keeps the float model's logits within a bound and its greedy tokens, through the lean decode
step (q/k/v and gate/up fused over int8 rows); an unknown method or a GPU device is refused
naming the allowed values and the flag."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.executor.outputs import finish_row
from engine.models import int8_linear, parts
from tests.engine.test_lean_decode import one_step_logits, running_batch
from tests.engine.test_scheduler import prompts_of
from tests.engine_fixtures import llm


def _weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen)
    w[3] = 0.0  # a row of zeros
    w[5, 7] = 250.0  # an outlier: its row's scale is large
    w[9] *= 1e-6  # a row of tiny values
    return w


def test_packing_round_trips_within_half_a_scale_per_element():
    w = _weights()
    q, scale = int8_linear.quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) <= int8_linear.QMAX
    assert torch.equal(scale.to(torch.bfloat16).to(torch.float32), scale)  # exact in bf16
    assert bool((scale * int8_linear.QMAX >= w.abs().amax(1)).all())  # nothing clipped
    error = (int8_linear.dequantize(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-6)).all())
    assert bool((int8_linear.dequantize(q, scale)[3] == 0).all())
    # the scale is the row's largest magnitude over 127, raised by at most 2**-8 + bf16's step
    nonzero = w.abs().amax(1) > 0
    ratio = scale[nonzero] * int8_linear.QMAX / w.abs().amax(1)[nonzero]
    assert float(ratio.max()) <= (1 + 2 ** -8) * (1 + 2 ** -8)


@pytest.mark.parametrize("rows", [1, 3, int8_linear.KERNEL_MAX_ROWS, 40])
def test_the_product_is_the_dequantized_weights_within_bfloat16_rounding(rows):
    w = _weights()
    bias = torch.randn(w.shape[0])
    q, scale = int8_linear.quantize_rows(w)
    x = torch.randn(2, rows, w.shape[1])  # (batch, rows, features): any leading shape
    got = int8_linear.product(x, q, scale, bias)
    want = torch.nn.functional.linear(x, int8_linear.dequantize(q, scale), bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    # activations and outputs rounded to bfloat16 (8 bits of mantissa): a few 2**-8 of the
    # products' magnitude
    magnitude = (x.abs() @ int8_linear.dequantize(q, scale).abs().T)
    assert bool(((got - want).abs() <= 3 * 2 ** -8 * magnitude + 1e-6).all())


def test_a_quantized_tiny_model_keeps_the_float_logits_within_a_bound():
    """The tiny Qwen2.5-VL quantized: every language-model linear layer is int8 (the output
    head and the vision tower are not), the lean step runs fused products over the int8 rows
    (the layers' rows views of one concatenation), and a decode step's logits over rows of
    different lengths stay within 2% of the float ones' largest, the same greedy tokens."""
    from engine import LLM

    plain = llm("qwen2_5_vl")
    quantized = LLM("tiny:qwen2_5_vl", quantization="int8")
    try:
        runner = quantized.engine.runner
        model = runner.model
        text = parts.language_model(model)
        linears = [m for m in text.modules() if type(m) is torch.nn.Linear]
        assert not linears
        int8 = [m for m in text.modules() if isinstance(m, int8_linear.Int8Linear)]
        assert len(int8) == 7 * len(text.layers)
        assert type(model.get_output_embeddings()) is torch.nn.Linear
        assert any(type(m) is torch.nn.Linear for m in model.model.visual.modules())
        assert runner.decode_path == "lean"
        for layer in text.layers:
            q, k = layer.self_attn.q_proj.qweight, layer.self_attn.k_proj.qweight
            assert k.data_ptr() == q.data_ptr() + q.numel()  # fused: one concatenation
        batches = [running_batch(r, prompts_of("qwen2_5_vl"))
                   for r in (plain.engine.runner, runner)]
        want = one_step_logits(plain.engine.runner, batches[0], lean=True)
        got = one_step_logits(runner, batches[1], lean=True)
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        own = one_step_logits(runner, batches[1], lean=False)  # the model's own forward
        assert float((own - got).abs().max()) <= 1e-3 * float(want.abs().max())
        for batch in batches:
            for row in batch.rows:
                finish_row(row, "abort")
    finally:
        quantized.close()


@pytest.mark.parametrize("method", ["int4", "INT8", "fp8", ""])
def test_an_unknown_method_is_refused_naming_the_allowed_ones(method):
    with pytest.raises(ConfigError) as info:
        EngineConfig(quantization=method)
    assert "--quantization" in info.value.message and repr(method) in info.value.message
    assert "int8" in info.value.hint


def test_int8_runs_on_a_cpu_device_only_and_is_off_by_default():
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ConfigError) as info:
        EngineConfig(quantization="int8", device="cuda")
    assert "--device cpu" in info.value.hint


def test_serve_refuses_an_unknown_method_in_one_line():
    import subprocess

    from tests.server_harness import BIN, free_port

    done = subprocess.run([str(BIN), "serve", "--quantization", "awq", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--quantization 'awq' is not supported" in done.stderr and "int8" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_vllm_is_not_handed_our_int8():
    from engine.server.vllm_adapter.vllm_spec import ours_only_flags

    assert [flag for flag, _ in ours_only_flags(EngineConfig(quantization="int8"))] == \
        ["--quantization"]
