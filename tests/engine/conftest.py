"""Fixtures of the decode kernels' tests: a tiny Qwen2.5-VL whose every decode product runs
through the engine's C kernels."""

from __future__ import annotations

import pytest
import torch

from engine.models import decode_kernels, lean_decode
from tests.engine_fixtures import llm


@pytest.fixture(scope="module")
def kernel_model():
    """A tiny Qwen2.5-VL of its own (no prefix cache: nothing it computes reaches another
    test) with norms of their own (a random model's are all ones: one norm taken for
    another would pass)."""
    from engine import LLM

    if decode_kernels.prepare() is None:
        pytest.skip("no C compiler on this machine")
    model = LLM("tiny:qwen2_5_vl", enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in model.engine.runner.model.named_modules():
            if name.endswith("norm") and "visual" not in name:
                module.weight.mul_(1 + 0.2 * torch.randn(module.weight.shape,
                                                         generator=generator))
    yield model
    model.close()


@pytest.fixture
def kernel_runner(kernel_model, monkeypatch):
    runner = kernel_model.engine.runner
    llm("qwen2_5_vl")  # (the prompts' shared tiny LLM, loaded before the patch below)
    # (every product through the linear kernel: the tiny model's weights are under the minimum)
    monkeypatch.setattr(decode_kernels, "MIN_LINEAR_WEIGHT", 0)
    monkeypatch.setattr(runner, "_lean_decode", lean_decode.for_model(runner.model))
    return runner
