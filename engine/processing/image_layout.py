"""Images and video frames handed to the HF processors in the layout their resize is fastest on.

An RGB image arrives as height x width x 3 bytes (PIL, a decoder's frame). The processors'
torchvision backend wants a (3, H, W) tensor and, in transformers 5.24, copies every image into
a contiguous channels-first tensor before resizing it (``TorchvisionBackend.process_image``).
torch's antialiased uint8 resize is 2-3x faster on the channels-last layout the image already
has (measured on 1280x720: bicubic 3.75 -> 1.57 ms, bilinear 1.65 -> 0.48 ms, values identical),
and the copy itself costs about as much as the fast resize. So the image goes in as a
channels-first *view* of its bytes, and the loaded image processor keeps that view instead of
copying it; every later step (resize, rescale, normalize, patching) gives the same values on
either layout (test_preprocess compares every family with the processor called on the PIL
image).

Decoded video frames ((frames, H, W, 3) uint8 arrays) get the same: the video processors'
``_prepare_input_videos`` also copies them into contiguous (frames, 3, H, W) tensors first
(16 frames of 320x240: 0.41-0.69x the processor time per family without that copy).
"""

from __future__ import annotations

import warnings
from typing import Any


def is_rgb_pil(data: Any) -> bool:
    return getattr(data, "mode", None) == "RGB" and hasattr(data, "tobytes")


def channels_first_view(image: Any) -> Any:
    """An RGB PIL image as a (3, H, W) uint8 tensor whose memory stays height x width x 3 (one
    copy of the pixels out of PIL, none to reorder them)."""
    import numpy as np
    import torch

    pixels = np.asarray(image)
    with warnings.catch_warnings():
        # read-only: PIL's bytes. Nothing writes into an input image; every step makes new ones.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pixels).permute(2, 0, 1)


def _is_channels_last_rgb(image: Any) -> bool:
    import torch

    return (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.ndim == 3
            and image.shape[0] == 3 and image.stride(0) == 1 and image.stride(2) == 3)


def _is_uint8_tensor(image: Any) -> bool:
    import torch

    return isinstance(image, torch.Tensor) and image.dtype == torch.uint8


class _KeepChannelsLast:
    """The image processor's ``process_image``: a channels-last (3, H, W) uint8 view is
    already RGB and channels-first in shape, so it goes on as it is (the backend's own
    conversion would only copy it into the slower layout); anything else goes to the class's
    method. A module-level callable holding its processor (not a closure): the processor stays
    picklable and copyable."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __call__(self, image: Any, *args: Any, **kwargs: Any) -> Any:
        # (ChannelDimension is a str enum: equal to its value)
        if not args and kwargs.get("device") is None and _is_channels_last_rgb(image) and \
                kwargs.get("input_data_format") == "channels_first":
            return image
        return type(self.owner).process_image(self.owner, image, *args, **kwargs)


class _ContiguousResize:
    """The image processor's ``resize``: the fast resize on the channels-last input, its
    uint8 output then made contiguous, the layout the float steps after it (rescale,
    normalize, patching) are fastest on (on 256x256 images they cost more than the resize
    saved otherwise). Also when the size did not change and the output is the input: the copy
    the backend's own conversion would have made."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = type(self.owner).resize(self.owner, *args, **kwargs)
        if _is_uint8_tensor(out) and not out.is_contiguous():
            return out.contiguous()
        return out


class _KeepChannelsLastVideos:
    """The video processor's ``_prepare_input_videos``: RGB frames as (frames, H, W, 3) uint8
    arrays (what the decoders return) become (frames, 3, H, W) channels-last views of the same
    memory, where the backend would copy them into a contiguous tensor; anything else goes to
    the class's method."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import numpy as np
        import torch

        videos = args[0] if args else kwargs.get("videos")
        if len(args) <= 1 and kwargs.get("device") is None and \
                kwargs.get("input_data_format") in (None, "channels_last") and \
                isinstance(videos, list) and videos and all(
                    isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 4
                    and v.shape[-1] == 3 and v.shape[1] > 4 for v in videos):
            with warnings.catch_warnings():  # a read-only array: nothing writes into it
                warnings.simplefilter("ignore", UserWarning)
                return [torch.from_numpy(v).permute(0, 3, 1, 2) for v in videos]
        return type(self.owner)._prepare_input_videos(self.owner, *args, **kwargs)


def keep_channels_last(processor: Any) -> None:
    """Let ``processor``'s torchvision image processor take channels-last RGB views as they
    are (see the module's docstring). Other inputs, and processors without that backend, are
    untouched; a second call changes nothing."""
    for attr, method, wrapper in (("image_processor", "process_image", _KeepChannelsLast),
                                  ("video_processor", "_prepare_input_videos",
                                   _KeepChannelsLastVideos)):
        part = getattr(processor, attr, None)
        cls = type(part)
        if part is None or not (callable(getattr(cls, method, None))
                                and callable(getattr(cls, "resize", None))):
            continue
        if isinstance(vars(part).get(method), wrapper):
            continue
        setattr(part, method, wrapper(part))
        part.resize = _ContiguousResize(part)
