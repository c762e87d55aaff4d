"""Image preprocessing against transformers' Qwen2-VL image processor (PIL backend)."""

from __future__ import annotations

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

from services.common.errors import InvalidRequestError, ModelLoadError
from services.engine.processing.image import (
    ImageProcessor,
    ImageProcessorConfig,
    _pil_pass_sizes,
    pixel_hash,
    smart_resize,
)
from services.engine.processing.image_file import content_hash, decode_image, to_rgb
from tests.conftest import TINY_MODEL_DIR
from tests.engine.image_helpers import encode, make_image, make_rgb

TINY_DIR = TINY_MODEL_DIR
SIZES = [
    (50, 80),
    (224, 224),
    (300, 97),
    (640, 480),
    (10, 30),
    (28, 28),
    (1000, 40),
]  # (width, height)


@pytest.fixture(scope="module")
def processor() -> ImageProcessor:
    return ImageProcessor.from_dir(TINY_DIR)


@pytest.fixture(scope="module")
def reference():
    # transformers' top-level AutoImageProcessor is a torchvision placeholder when
    # torchvision is absent; the module's own class resolves the PIL backend.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(TINY_DIR), backend="pil")


def assert_matches_reference(processor: ImageProcessor, reference, image: Image.Image) -> None:
    ours = processor.preprocess(image)
    ref = reference(images=[image], return_tensors="pt")
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-5
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_preprocess_matches_transformers_sizes(processor, reference, width, height):
    assert_matches_reference(processor, reference, make_rgb(width, height))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "LA"])
def test_preprocess_matches_transformers_modes(processor, reference, mode):
    assert_matches_reference(processor, reference, make_image(mode))


def test_rgba_conversion_drops_alpha_like_transformers():
    from transformers.image_transforms import convert_to_rgb

    image = make_image("RGBA")
    assert np.array_equal(np.asarray(to_rgb(image)), np.asarray(convert_to_rgb(image)))


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_grid_for_agrees_with_preprocess(processor, reference, width, height):
    image = make_rgb(width, height)
    grid = processor.grid_for(image)
    processed = processor.preprocess(image)
    assert grid == processed.grid_thw
    assert processed.pixel_values.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)
    assert grid[1] * grid[2] == reference.get_number_of_image_patches(height, width)
    assert 4 <= processor.num_image_tokens(grid) <= 64


def test_tiny_image_is_upscaled(processor):
    assert processor.grid_for_size(30, 10) == (1, 8, 4)  # 112x56 pixels, 14-pixel patches


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for height in [1, 5, 13, 27, 28, 29, 55, 100, 223, 480, 999, 2048, 4321]:
        for width in [1, 7, 28, 41, 97, 224, 640, 1023, 3000]:
            if max(height, width) / min(height, width) > 200:
                continue
            for limits in [(56 * 56, 28 * 28 * 64), (56 * 56, 28 * 28 * 1280)]:
                assert smart_resize(height, width, 28, *limits) == reference(
                    height, width, 28, *limits
                )


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 64)


def test_pixel_hash_ignores_container_format(processor):
    image = make_rgb(64, 48)
    png = decode_image(encode(image, "PNG"), max_bytes=1 << 20)
    bmp = decode_image(encode(image, "BMP"), max_bytes=1 << 20)
    assert content_hash(encode(image, "PNG")) != content_hash(encode(image, "BMP"))
    assert pixel_hash(processor.preprocess(png)) == pixel_hash(processor.preprocess(bmp))


# The torch path (the encoder's GPU preprocessing) on the CPU device against the PIL path.
# Measured (Pillow 13.0, torch 2.13, CPU): max |torch - PIL| of the normalized values is
# 0.0150 = one uint8 level (1 / 255 / min std), on at most 0.2% of the values; 0 at
# 56x56 (no resize) and 30x10 (upscaled past min_pixels).
ONE_LEVEL = 1 / 255 / min(ImageProcessor.from_dir(TINY_DIR).config.image_std)
TENSOR_SIZES = [(1920, 1080), (640, 480), (56, 56), (300, 97), (1000, 40), (30, 10), (480, 640)]
SEVEN_B = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)  # Qwen2.5-VL-7B


def assert_tensor_path_close(processor: ImageProcessor, image: Image.Image) -> None:
    exact = processor.preprocess(image)
    ours = processor.preprocess_tensor(torch.from_numpy(np.array(image))[None])
    assert ours.dtype == torch.float32 and ours.shape == exact.pixel_values.shape
    diff = (ours - exact.pixel_values).abs()
    assert diff.max().item() <= ONE_LEVEL * (1 + 1e-4)
    assert (diff > 1e-6).float().mean().item() <= 0.005


@pytest.mark.parametrize(("width", "height"), TENSOR_SIZES)
@pytest.mark.parametrize("config", ["tiny", "7b"])
def test_preprocess_tensor_is_within_one_level_of_pil(processor, config, width, height):
    processor = processor if config == "tiny" else ImageProcessor(SEVEN_B)
    assert_tensor_path_close(processor, make_rgb(width, height, seed=width))


def test_preprocess_tensor_takes_a_batch_of_one_size_in_order(processor):
    images = [make_rgb(300, 97, seed=seed) for seed in (1, 2, 3)]
    batch = torch.stack([torch.from_numpy(np.array(image)) for image in images])
    single = [processor.preprocess_tensor(row[None]) for row in batch]
    assert torch.equal(processor.preprocess_tensor(batch), torch.cat(single))


def test_pil_pass_order_follows_the_installed_pillow():
    # 640x480 -> 644x476 (7B dims): Pillow 13 resizes vertically first, older Pillow
    # horizontally; the wrong order is 17 levels off (test_preprocess_tensor_... catches it).
    is_pillow13 = int(PIL.__version__.split(".")[0]) >= 13
    first = (476, 640) if is_pillow13 else (480, 644)
    assert _pil_pass_sizes((480, 640), (476, 644)) == [first, (476, 644)]
    assert _pil_pass_sizes((56, 56), (56, 56)) == []
    assert _pil_pass_sizes((97, 300), (98, 308)) == [(97, 308), (98, 308)]


def test_preprocess_tensor_refuses_a_filter_without_a_torch_twin():
    lanczos = ImageProcessor(ImageProcessorConfig(resample=int(Image.Resampling.LANCZOS)))
    with pytest.raises(ModelLoadError, match="resample=1 has no torch path"):
        lanczos.preprocess_tensor(torch.zeros(1, 56, 56, 3, dtype=torch.uint8))
