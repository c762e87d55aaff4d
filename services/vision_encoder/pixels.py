"""Pixels for one ViT call: the encoder rank's one preprocessing function (the device seam).

Images are decoded on the CPU (``decode_image``: a bad file is one job's error). This
function turns the decoded images of a step into the ViT's input on the rank's device.
Today it resizes, rescales, normalizes and patchifies on the CPU, bit-exact with
transformers' PIL processor, and copies the patches to ``device``; a GPU path (resize and
normalize on ``device``, within a stated tolerance) replaces its body for CUDA devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

from services.engine.processing.image import ImageProcessor


def prepare_pixels(
    processor: ImageProcessor, images: Sequence[Image.Image], device: torch.device
) -> torch.Tensor:
    """The ViT input of ``images``, in order: [sum of patches, C * t * p * p] float32 on ``device``.

    Each image's grid is ``processor.grid_for(image)``.
    """
    patches = [processor.preprocess(image).pixel_values for image in images]
    return torch.cat(patches).to(device)
