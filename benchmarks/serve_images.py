"""Synthetic images for the serving benchmark.

``noise`` (the default) is uniform random RGB pixels, what sglang's ``bench_serving``
(``--image-content random``) and ``vllm bench serve`` (``random-mm``) send: such a file
is as large as a photo's or larger (a 1920x1080 noise JPEG at quality 90 is ~1.8 MB),
so upload, decode and hashing cost what they cost with real images. ``gradient`` is
smooth seed-shifted gradients (tens of KB: what this client sent before) and ``blank``
one flat colour. Every image has its seed written into its first pixels, so no two
images of a run are equal and no embedding or prefix cache on the server can hit.
"""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
from PIL import Image

IMAGE_KINDS = ("noise", "gradient", "blank")
IMAGE_FORMATS = ("jpeg", "png")
JPEG_QUALITY = 90
RESOLUTIONS = {"4k": (3840, 2160), "1080p": (1920, 1080), "720p": (1280, 720), "360p": (640, 360)}
_MIME = {"jpeg": "image/jpeg", "png": "image/png"}


def parse_size(text: str) -> tuple[int, int]:
    """``WxH`` or one of ``RESOLUTIONS`` (sglang's presets) as (width, height)."""
    if text.lower() in RESOLUTIONS:
        return RESOLUTIONS[text.lower()]
    width, _, height = text.lower().partition("x")
    size = (int(width), int(height))
    if min(size) <= 0:
        presets = ", ".join(RESOLUTIONS)
        raise ValueError(f"bad image size {text!r}: need WxH with W, H > 0, or one of {presets}")
    return size


def image_pixels(kind: str, width: int, height: int, seed: int) -> np.ndarray:  # [H, W, 3] uint8
    if kind == "noise":
        pixels = np.random.default_rng(seed).integers(
            0, 256, size=(height, width, 3), dtype=np.uint8
        )
    elif kind == "gradient":
        x, y = np.arange(width), np.arange(height)[:, None]
        pixels = np.empty((height, width, 3), np.uint8)
        pixels[:, :, 0] = (x + seed * 7) % 256
        pixels[:, :, 1] = (y + seed * 13) % 256
        pixels[:, :, 2] = ((x // 8 + y // 8) * (seed % 31 + 1)) % 256
    elif kind == "blank":
        pixels = np.full((height, width, 3), 255, np.uint8)
    else:
        raise ValueError(f"unknown image kind {kind!r}; expected one of {', '.join(IMAGE_KINDS)}")
    seed_bytes = np.frombuffer(struct.pack(">Q", seed % 2**64), dtype=np.uint8)
    flat = pixels.reshape(-1)
    flat[: min(len(flat), len(seed_bytes))] = seed_bytes[: len(flat)]
    return pixels


def image_bytes(kind: str, fmt: str, width: int, height: int, seed: int) -> bytes:
    """The image file: JPEG at ``JPEG_QUALITY`` or PNG."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(
            f"unknown image format {fmt!r}; expected one of {', '.join(IMAGE_FORMATS)}"
        )
    buffer = io.BytesIO()
    image = Image.fromarray(image_pixels(kind, width, height, seed), "RGB")
    if fmt == "jpeg":
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_data_url(kind: str, fmt: str, width: int, height: int, seed: int) -> str:
    data = base64.b64encode(image_bytes(kind, fmt, width, height, seed)).decode("ascii")
    return f"data:{_MIME[fmt]};base64,{data}"
