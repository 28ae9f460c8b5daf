"""The linear kernel over int8 rows (``--quantization int8``: decode_kernels.linear_int8,
csrc/decode_linear.c): the product of the dequantized weight within the rounding bound of a
float32 sum, a row's bits the same whatever its batch-mates and threads, wider inputs to the
product it was given, what it refuses; and the lean decode step of a quantized model runs
every int8 product through it (and the operations between them in C), its logits those of the
float step over the dequantized weights within float32 rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.executor.outputs import finish_row
from engine.models import decode_kernels, int8_linear, lean_decode, parts
from tests.engine.test_decode_linear import EPS, assert_batch_invariant, lib  # noqa: F401
from tests.engine.test_lean_decode import one_step_logits, running_batch
from tests.engine.test_scheduler import prompts_of

#: every test here needs the kernels built (skipped where there is no C compiler)
pytestmark = pytest.mark.usefixtures("lib")


def _quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[1] *= 40.0  # a row of large values: its own scale
    q, scale = int8_linear.quantize_rows(w)
    return q, scale, int8_linear.dequantize(q, scale)


@pytest.mark.parametrize("n,k", [(512, 256), (100, 701), (1000, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_is_the_dequantized_product_within_the_rounding_bound(n, k, with_bias):
    """Each output is its column's float32 sum of x times the int8 values, times the scale,
    plus the bias: within (k + 3) units in the last place of the sum of magnitudes of the
    float64 product over the dequantized weight."""
    q, scale, dequantized = _quantized(n, k, n + k)
    bias = torch.randn(n) if with_bias else None
    product = decode_kernels.linear_int8(q, scale, bias, lambda x: None)
    assert product is not None
    for rows in (1, 2, 3, 5, 8, 9, 17, 64, 65, 100):
        x = torch.randn(rows, 1, k)
        out = product(x)
        assert out.shape == (rows, 1, n) and out.dtype == torch.float32
        want = torch.nn.functional.linear(x.double(), dequantized.double(),
                                          None if bias is None else bias.double())
        magnitude = x.double().abs() @ dequantized.double().abs().T
        if bias is not None:
            magnitude = magnitude + bias.double().abs()
        error = (out.double() - want).abs()
        assert bool((error <= (k + 3) * EPS * magnitude + 1e-30).all()), rows


def test_a_rows_result_never_depends_on_its_batch_mates_or_threads():
    q, scale, _ = _quantized(600, 320, 0)
    assert_batch_invariant(decode_kernels.linear_int8(q, scale, torch.randn(600),
                                                      lambda x: None), 320, (1, 3, 4, 8, 9, 20, 70))


def test_wider_inputs_go_to_the_product_given_and_what_it_refuses():
    """Any number of rows runs through it (a step of many rows is not sent to the module's
    own product, bfloat16 there: a row's logits would change with its batch's size); an input
    of another dtype goes to the product given; float weights, a scale of the wrong size or
    type, a small weight are not taken."""
    q, scale, _ = _quantized(300, 256, 1)
    calls = []

    def wider(x):
        calls.append(x.shape[0])
        return int8_linear.product(x, q, scale, None)

    product = decode_kernels.linear_int8(q, scale, None, wider)
    many = torch.randn(200, 256)
    out = product(many)
    assert calls == []
    assert torch.equal(out[:3], product(many[:3]))  # (its rows' bits, not bfloat16's)
    assert not torch.equal(out, int8_linear.product(many, q, scale, None))
    half = many.to(torch.bfloat16)
    assert torch.equal(product(half), int8_linear.product(half, q, scale, None))
    assert calls == [200]
    assert decode_kernels.linear_int8(q.float(), scale, None, wider) is None
    assert decode_kernels.linear_int8(q, scale[:-1], None, wider) is None
    assert decode_kernels.linear_int8(q, scale.double(), None, wider) is None
    small_q, small_scale = int8_linear.quantize_rows(torch.randn(64, 64))
    assert decode_kernels.linear_int8(small_q, small_scale, None, wider) is None


def test_the_lean_step_of_a_quantized_model_runs_the_int8_products_through_it(monkeypatch):
    """The tiny Qwen2.5-VL quantized, every weight taken (the tiny weights are under the
    minimum): a decode step of rows of different lengths runs its int8 products (fused
    q/k/v and gate/up, o, down) and the float head through the kernel, with the operations
    between them in C; its logits are those of the float model whose weights are the
    dequantized int8 ones (one more instance, its lean step on the float kernel; the
    prefills in float32 on both) within float32 rounding, the same greedy tokens."""
    from engine import LLM

    # (the prompts' shared tiny LLM loaded before the patches, or its later tests would run
    # the kernels too)
    prompts = prompts_of("qwen2_5_vl")
    monkeypatch.setattr(decode_kernels, "MIN_LINEAR_WEIGHT", 0)
    # the prefills' products (bfloat16 in the product) in float32 over the dequantized
    # weight: both models' caches then hold the same values within float32 rounding
    monkeypatch.setattr(int8_linear, "product", lambda x, q, scale, bias: torch.nn.functional
                        .linear(x, int8_linear.dequantize(q, scale), bias))
    quantized = LLM("tiny:qwen2_5_vl", quantization="int8")
    plain = LLM("tiny:qwen2_5_vl")
    batches = []
    try:
        runner, reference = quantized.engine.runner, plain.engine.runner
        text = parts.language_model(reference.model)
        with torch.no_grad():
            for module in text.layers.modules():
                if type(module) is torch.nn.Linear:
                    module.weight.copy_(int8_linear.dequantize(
                        *int8_linear.quantize_rows(module.weight)))
        steps = [lean_decode.for_model(r.model) for r in (runner, reference)]
        layers = len(text.layers)
        assert [s.kernel_products for s in steps] == [4 * layers + 1] * 2
        assert all(getattr(s, "eager", None) is not None for s in steps)  # (all in C)
        ran = []

        def counted(*args, whole=steps[0].whole):
            ran.append(whole(*args))
            return ran[-1]

        monkeypatch.setattr(runner, "_lean_decode", functools.partial(steps[0], whole=counted))
        monkeypatch.setattr(reference, "_lean_decode", steps[1])
        batches = [running_batch(r, prompts) for r in (runner, reference)]
        got = one_step_logits(runner, batches[0], lean=True)
        want = one_step_logits(reference, batches[1], lean=True)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the layers ran in one call (decode_layers): the same bits as one call each
        assert ran == [True]
        monkeypatch.setattr(runner, "_lean_decode", functools.partial(steps[0], whole=None))
        assert torch.equal(one_step_logits(runner, batches[0], lean=True), got)
    finally:
        for batch in batches:
            for row in batch.rows:
                finish_row(row, "abort")
        quantized.close()
        plain.close()
