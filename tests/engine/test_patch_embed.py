"""Patch embeddings as matrix products: the Qwen-VL families' one-patch Conv3d runs as a
product (same values up to float rounding); any other input still runs the convolution."""

from __future__ import annotations

import pytest
import torch

from engine.models.patch_embed import convolutions_as_products
from tests.engine_fixtures import llm


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_one_patch_convolutions_run_as_products_with_the_convolutions_values(arch):
    model = llm(arch).engine.runner.model
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(type(m).__name__ == "PatchConv3d" for m in convs)
    conv = convs[0]
    patches = torch.randn(50, conv.in_channels, *conv.kernel_size,
                          generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fast = conv(patches)
        slow = torch.nn.Conv3d.forward(conv, patches)
        assert fast.shape == slow.shape
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        wider = torch.randn(2, conv.in_channels, conv.kernel_size[0],
                            conv.kernel_size[1] * 2, conv.kernel_size[2] * 2)
        assert torch.equal(conv(wider), torch.nn.Conv3d.forward(conv, wider))  # not one patch


def test_only_kernel_equals_stride_convolutions_switch():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=4, stride=4, bias=True),  # a patch embedding
        torch.nn.Conv2d(8, 8, kernel_size=3, stride=1, padding=1),  # an ordinary convolution
        torch.nn.Conv2d(8, 8, kernel_size=2, stride=2, groups=2))
    assert convolutions_as_products(net) == 1
    assert [type(m).__name__ for m in net] == ["PatchConv2d", "Conv2d", "Conv2d"]
    x = torch.randn(5, 3, 4, 4)
    torch.testing.assert_close(net[0](x), torch.nn.Conv2d.forward(net[0], x), rtol=1e-5,
                               atol=1e-6)
    assert net[0].state_dict().keys() == {"weight", "bias"}
