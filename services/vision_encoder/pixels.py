"""Pixels for one ViT call: the encoder rank's one preprocessing function (the device seam).

Images are decoded on the CPU (``decode_pixels``: a bad file is one job's error). This
function turns the decoded pixels of a step into the ViT's input on the rank's device, by
one of two methods (``--pixel-method``; ``auto`` picks by device):
- ``pil`` (CPU ranks): resize, rescale, normalize and patchify on the CPU, bit-exact with
  transformers' PIL processor; the patches are copied to ``device``;
- ``torch`` (CUDA ranks): the step's uint8 pixels go to ``device`` in one copy; resize,
  normalize and patchify run there (``ImageProcessor.preprocess_tensor``, one call per
  input size), within one uint8 level of the PIL path.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from services.engine.processing.image import ImageProcessor
from services.vision_encoder.config import PIXEL_METHODS


class PixelMethod(enum.Enum):
    PIL = "pil"
    TORCH = "torch"


def resolve_method(name: str, device: torch.device) -> PixelMethod:
    """``auto``: torch on a CUDA device, PIL elsewhere; else the named method."""
    assert name in PIXEL_METHODS, name
    if name == "auto":
        return PixelMethod.TORCH if device.type == "cuda" else PixelMethod.PIL
    return PixelMethod(name)


def prepare_pixels(
    processor: ImageProcessor,
    images: Sequence[np.ndarray],
    device: torch.device,
    method: PixelMethod,
) -> torch.Tensor:
    """The ViT input of ``images`` ([H, W, 3] uint8 each), in order: [sum of patches,
    C * t * p * p] float32 on ``device``.

    Each image's grid is ``processor.grid_for_size(H, W)``. The torch method's device work may
    still be running when this returns (the caller synchronizes to time it).
    """
    if method is PixelMethod.PIL:
        patches = [processor.preprocess(Image.fromarray(a)).pixel_values for a in images]
        return torch.cat(patches).to(device)
    return _torch_pixels(processor, list(images), device)


def _torch_pixels(
    processor: ImageProcessor, arrays: list[np.ndarray], device: torch.device
) -> torch.Tensor:
    sizes = [a.size for a in arrays]
    # Pinned through torch's caching host allocator: reused across steps, and kept until
    # the copy that reads it is done.
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    np.concatenate([a.reshape(-1) for a in arrays], out=host.numpy())  # [sum H*W*3] uint8
    views = host.to(device, non_blocking=True).split(sizes)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for index, array in enumerate(arrays):
        by_shape.setdefault(array.shape, []).append(index)
    patches: list[torch.Tensor | None] = [None] * len(arrays)
    for shape, indices in by_shape.items():
        batch = torch.stack([views[i].view(shape) for i in indices])  # [N, H, W, 3] uint8
        out = processor.preprocess_tensor(batch)  # [N * patches, C * t * p * p]
        for i, part in zip(indices, out.chunk(len(indices)), strict=True):
            patches[i] = part
    return torch.cat(patches)
