"""oneDNN linear layers with packed weights (engine/models/cpu_linear.py): the same results as
``F.linear`` (within float32 rounding) for every input shape the engine gives them, on every
family's real model; the plain path for one row, other dtypes and gradients; off by env."""

from __future__ import annotations

import pytest

from engine import envs
from engine.models import cpu_linear
from tests.engine.test_scheduler import media_item
from tests.engine_fixtures import FAMILIES, llm

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN")


def _calls(monkeypatch) -> list:
    """Count the packed operator's calls (the module resolves its overload when packing)."""
    calls: list = []
    real = torch.ops.mkldnn._linear_pointwise.default

    class Counting:
        def __call__(self, *args):
            calls.append(tuple(args[0].shape))
            return real(*args)

        @property
        def default(self):
            return self

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Counting())
    return calls


def test_a_packed_linear_gives_f_linear_results_for_every_shape(monkeypatch):
    calls = _calls(monkeypatch)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False))
    plain = [torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)]
    for p, layer in zip(plain, layers, strict=True):
        p.load_state_dict(layer.state_dict())
    assert cpu_linear.pack_linears(layers) == 0  # under the default smallest weight
    assert cpu_linear.pack_linears(layers, min_weight=64 * 96) == 1  # the first only
    del layers[0].__dict__["forward"]
    assert cpu_linear.pack_linears(layers, min_weight=0) == 2
    with torch.inference_mode():
        for shape in [(37, 64), (2, 9, 64), (8, 1, 64), (5, 64)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(layers(x), plain[1](plain[0](x)), atol=1e-5, rtol=1e-5)
        assert len(calls) == 8  # every shape of 4 rows or more went through oneDNN
        one = torch.randn(1, 1, 64)  # a lone decode row: the plain path, the same bits
        assert torch.equal(layers(one), plain[1](plain[0](one)))
        assert len(calls) == 8
        assert layers(torch.randn(6, 64, dtype=torch.float64).float()).shape == (6, 32)
    # gradients: the plain path (oneDNN's packed operator has no backward)
    before = len(calls)
    x = torch.randn(6, 64, requires_grad=True)
    layers(x).sum().backward()
    assert x.grad is not None and len(calls) == before


def test_layers_under_the_smallest_weight_keep_pytorchs_path(monkeypatch):
    """The default threshold: a tiny model's 128 x 256 layer is not packed (oneDNN's fixed
    cost per call loses there), a 512 x 1024 one is; the env var moves the line, and a
    weight handed to ``linear`` follows the same rule."""
    small, large = torch.nn.Linear(128, 256), torch.nn.Linear(1024, 512)
    assert cpu_linear.pack_linears(torch.nn.Sequential(small, large)) == 1
    assert "forward" not in small.__dict__ and "forward" in large.__dict__
    calls = _calls(monkeypatch)
    owner = torch.nn.Module()
    with torch.inference_mode():
        cpu_linear.linear(owner, torch.randn(12, 128), small.weight, None)
        assert calls == []
        monkeypatch.setenv("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", str(128 * 256))
        torch.testing.assert_close(cpu_linear.linear(owner, torch.randn(12, 128), small.weight,
                                                     small.bias).shape, (12, 256))
    assert calls == [(12, 128)]
    monkeypatch.setenv("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", "-1")
    with pytest.raises(Exception, match="APHRODITE_CPU_ONEDNN_MIN_WEIGHT"):
        cpu_linear.pack_linears(torch.nn.Linear(4, 4))


def test_turned_off_by_its_environment_variable(monkeypatch):
    monkeypatch.setenv("APHRODITE_CPU_ONEDNN_LINEAR", "0")
    assert envs.APHRODITE_CPU_ONEDNN_LINEAR is False
    layer = torch.nn.Linear(8, 8)
    assert cpu_linear.pack_linears(layer) == 0 and "forward" not in layer.__dict__


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_familys_logits_are_those_of_its_unpacked_layers(arch, monkeypatch):
    """A prompt with the family's first modality through the loaded (packed) model, then with
    every packed forward removed: the same logits."""
    model = llm(arch)
    runner_model = model.engine.runner.model
    before = {m for m in runner_model.modules() if "forward" in m.__dict__}
    cpu_linear.pack_linears(runner_model, min_weight=0)  # the tiny models' layers are small
    packed = [m for m in runner_model.modules() if "forward" in m.__dict__
              and isinstance(m, torch.nn.Linear)]
    assert packed, "the engine's model has no packed linear layer"
    spec = model.loaded.spec
    modality = spec.modalities[0]
    prompt = model.prepare("Look: " + spec.placeholders[modality] + " What is it?",
                           [media_item(modality, 1)], None, False)[1]
    from engine.processing import device_normalize

    runner = model.engine.runner
    ids = torch.tensor([prompt.input_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              **device_normalize.apply(prompt.mm, runner.normalizers)}
    calls = _calls(monkeypatch)
    with torch.inference_mode():
        with_packed = runner_model(**inputs).logits
    assert calls  # the prompt went through oneDNN
    saved = {m: m.__dict__.pop("forward") for m in packed}
    try:
        with torch.inference_mode():
            plain = runner_model(**inputs).logits
    finally:  # the shared model as it was loaded
        for m, forward in saved.items():
            if m in before:
                m.forward = forward
    torch.testing.assert_close(with_packed, plain, atol=1e-4, rtol=1e-4)


def test_a_weight_packed_for_its_owner_is_packed_again_when_it_changes(monkeypatch):
    monkeypatch.setenv("APHRODITE_CPU_ONEDNN_MIN_WEIGHT", "0")
    calls = _calls(monkeypatch)
    owner = torch.nn.Module()
    x = torch.randn(12, 32)
    first, second = torch.randn(16, 32), torch.randn(16, 32)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(owner, x, first, None),
                                   torch.nn.functional.linear(x, first), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cpu_linear.linear(owner, x, second, None),
                                   torch.nn.functional.linear(x, second), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
