"""Deterministic test images and their encoded bytes, shared by the image tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def make_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack(
        [xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), (xs + ys) % 256], axis=-1
    )
    noise = rng.integers(-40, 41, size=base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), mode="RGB")


def make_image(mode: str, width: int = 123, height: int = 77) -> Image.Image:
    rgb = make_rgb(width, height, seed=len(mode))
    if mode == "RGBA":
        alpha = np.zeros((height, width), dtype=np.uint8)
        alpha[:, width // 3 :] = 128
        alpha[:, 2 * width // 3 :] = 255
        image = rgb.convert("RGBA")
        image.putalpha(Image.fromarray(alpha, mode="L"))
        return image
    if mode == "P":
        return rgb.quantize(colors=32)
    return rgb.convert(mode)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()
