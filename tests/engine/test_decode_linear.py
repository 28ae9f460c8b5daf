"""The decode step's linear kernel (engine/models/decode_kernels.py, csrc/decode_linear.c),
built with this machine's C compiler: within the rounding bound of any float32 sum of k
products of a float64 reference, for widths that are not whole panels, odd input sizes,
biases, strided and 3-D inputs; each row's result the same bits whatever its batch-mates,
its place among them and the threads; wider inputs go to the product it was given; and the
lean decode step runs its products through it (logits within the bound of the model's own
forward, the same greedy tokens), and with both kernels a row's logits in a decode step are
the same bits alone and beside batch-mates of other lengths."""

from __future__ import annotations

import pytest
import torch

from engine.models import decode_kernels, lean_decode
from tests.engine.test_lean_decode import one_step_logits, running_batch
from tests.engine.test_scheduler import prompts_of
from tests.engine_fixtures import llm

EPS = 2.0 ** -24


@pytest.fixture
def lib():
    lib = decode_kernels.prepare()
    if lib is None:
        pytest.skip("no C compiler on this machine")
    return lib


def _bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The rounding bound of a float32 sum of k products (and a bias) in any order: (k + 1)
    units in the last place of the sum of magnitudes, per output."""
    k = weight.shape[1]
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return (k + 2) * EPS * magnitude + 1e-30


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double(),
                                      None if bias is None else bias.double())


@pytest.mark.parametrize("n,k", [(512, 256), (100, 701), (768, 96), (1000, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_is_within_the_rounding_bound(lib, n, k, with_bias):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k) * 0.05
    bias = torch.randn(n) if with_bias else None
    product = decode_kernels.linear(weight, bias)
    assert product is not None
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 64, 65, 100):
        x = torch.randn(rows, 1, k)
        out = product(x)
        assert out.shape == (rows, 1, n) and out.dtype == torch.float32
        error = (out.double() - _reference(x, weight, bias)).abs()
        assert bool((error <= _bound(x, weight, bias)).all()), (rows, float(error.max()))
    # an input whose rows are strided (a view of a wider tensor), and one whose last
    # dimension is not contiguous
    wide = torch.randn(6, k + 40)[:, 3:3 + k]
    columns = torch.randn(k, 5).T
    for x in (wide, columns):
        error = (product(x).double() - _reference(x, weight, bias)).abs()
        assert bool((error <= _bound(x, weight, bias)).all())


def test_a_rows_result_never_depends_on_its_batch_mates_or_threads(lib):
    """Row 0's output alone, and at the start, middle and end of 1 to 131 other rows, on one
    thread and on two: the same bits."""
    torch.manual_seed(0)
    weight, bias = torch.randn(600, 320) * 0.05, torch.randn(600)
    assert_batch_invariant(decode_kernels.linear(weight, bias), 320,
                           (1, 2, 3, 4, 5, 8, 9, 13, 16, 20, 70, 131))


def assert_batch_invariant(product, k: int, counts: tuple[int, ...]) -> None:
    """A row's output from ``product`` alone, and at the start, middle and end of each of
    ``counts`` other rows, on one thread and on two: the same bits."""
    row = torch.randn(1, k)
    alone = product(row)[0]
    threads = torch.get_num_threads()
    try:
        for count in counts:
            for where in sorted({0, count // 2, count}):
                others = torch.randn(count, k) * 3
                x = torch.cat([others[:where], row, others[where:]])
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert torch.equal(product(x)[where], alone), (count, where, t)
    finally:
        torch.set_num_threads(threads)


def test_wider_inputs_and_what_it_does_not_take(lib, monkeypatch):
    """Any number of rows runs through it (a step of many is not sent elsewhere); an input
    that needs gradients, or of another dtype, goes to the product given for them (F.linear
    by default); a small weight, float64 weight or a bias of the wrong size is not taken at
    all."""
    weight = torch.randn(300, 256)
    calls = []

    def wider(x):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight.to(x.dtype))

    product = decode_kernels.linear(weight, None, wider)
    many = torch.randn(200, 256)
    error = (product(many).double() - _reference(many, weight, None)).abs()
    assert bool((error <= _bound(many, weight, None)).all())
    assert calls == []
    wide = torch.randn(3, 256, dtype=torch.float64)
    assert torch.equal(product(wide), torch.nn.functional.linear(wide, weight.double()))
    assert calls == [3]
    plain = decode_kernels.linear(weight, None)
    grad = torch.randn(2, 256, requires_grad=True)
    assert plain(grad).requires_grad
    assert decode_kernels.linear(torch.randn(64, 64), None) is None  # (under the minimum)
    assert decode_kernels.linear(weight.double(), None) is None
    assert decode_kernels.linear(weight, torch.randn(299)) is None
    monkeypatch.setenv("APHRODITE_DECODE_LINEAR_KERNEL", "0")
    assert decode_kernels.linear(weight, None) is None


def test_the_lean_step_runs_its_products_through_it(lib, monkeypatch):
    """With every product taken (the tiny model's weights are under the minimum), a decode
    step of rows of different lengths runs each layer's qkv, o, gate/up and down products
    and the head through the kernel; its logits are within the kernel's rounding bound of
    the model's own forward (which runs PyTorch's products), with the same greedy tokens."""
    runner = llm("qwen2_5_vl").engine.runner  # (loaded first: its own step as it loads)
    monkeypatch.setattr(decode_kernels, "MIN_LINEAR_WEIGHT", 0)
    built: list = []
    real = decode_kernels.linear

    def spy(weight, bias, wider=None):
        product = real(weight, bias, wider)
        if product is None:
            return None

        def counted(x):
            built.append(x.shape[0])
            return product(x)

        counted.panels = product.panels
        return counted

    monkeypatch.setattr(decode_kernels, "linear", spy)
    step = lean_decode.for_model(runner.model)
    layers = runner.model.config.get_text_config().num_hidden_layers
    monkeypatch.setattr(runner, "_lean_decode", step)
    batch = running_batch(runner, prompts_of("qwen2_5_vl"))
    rows = len(batch.rows)
    lean = one_step_logits(runner, batch, lean=True)
    own = one_step_logits(runner, batch, lean=False)
    assert built == [rows] * (4 * layers + 1)
    assert step.kernel_products == 4 * layers + 1  # (what bench decode-step reports)
    assert step.eager is not None  # (and the operations between them in the C kernels)
    assert torch.equal(lean.argmax(-1), own.argmax(-1))
    torch.testing.assert_close(lean, own, atol=1e-5, rtol=1e-4)
    from engine.executor.outputs import finish_row

    for row in batch.rows:
        finish_row(row, "abort")


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """The tiny Qwen2.5-VL with head_dim 32: every elementwise tensor of a step (rotary's
    cos and sin over 3 x rows x 32, the MLP's 256 wide) a whole number of PyTorch's vector
    loops, as in real models (with the tests' 16, rotary's last 16 values of a step fall in
    the scalar tail of PyTorch's vectorized cos/sin or not, by the row count)."""
    from engine import LLM
    from engine.models.tiny import build_tiny

    folder = tmp_path_factory.mktemp("wide") / "m"
    build_tiny("qwen2_5_vl", folder, head_dim=32)
    model = LLM(str(folder), enable_prefix_caching=False)  # (each prefill computed whole)
    yield model
    model.close()


def test_with_both_kernels_a_decode_rows_logits_do_not_depend_on_its_batch_mates(
        lib, monkeypatch, wide_heads):
    """Each row prefilled alone and whole (its cache the same bits every time: no prefix cache,
    whose hit would compute the prompt's last tokens apart), then one lean decode
    step of the rows together (left-padded to the longest) and one of each row alone: the
    same logits, bit for bit, on one thread and on two."""
    from engine.executor.outputs import finish_row

    prompts = prompts_of("qwen2_5_vl")  # (its shared LLM loaded before the patch)
    monkeypatch.setattr(decode_kernels, "MIN_LINEAR_WEIGHT", 0)
    runner = wide_heads.engine.runner
    monkeypatch.setattr(runner, "_lean_decode", lean_decode.for_model(runner.model))
    threads = torch.get_num_threads()
    batches = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            batches.append(running_batch(runner, prompts))
            assert not bool(batches[-1].mask.all())  # (rows of different lengths: padding)
            together = one_step_logits(runner, batches[-1], lean=True)
            for i, prompt in enumerate(prompts):
                batches.append(running_batch(runner, [prompt]))
                alone = one_step_logits(runner, batches[-1], lean=True)
                assert torch.equal(alone[0], together[i]), (t, i)
    finally:
        torch.set_num_threads(threads)
        for batch in batches:
            for row in batch.rows:
                finish_row(row, "abort")
