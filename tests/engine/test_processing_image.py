"""Image preprocessing against transformers' Qwen2-VL image processor (PIL backend)."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import PIL
import pytest
import torch
from PIL import Image, ImageFile

from services.common.errors import InvalidRequestError, ModelLoadError
from services.engine.processing.image import (
    ImageProcessor,
    ImageProcessorConfig,
    _pil_pass_sizes,
    content_hash,
    decode_image,
    decode_pixels,
    image_size,
    pixel_hash,
    smart_resize,
    to_rgb,
)
from tests.conftest import TINY_MODEL_DIR

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


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_decode_image_round_trip(mode):
    image = make_image(mode)
    decoded = decode_image(encode(image), max_bytes=1 << 20)
    assert decoded.mode == "RGB"
    assert decoded.size == image.size
    assert np.array_equal(np.asarray(decoded), np.asarray(to_rgb(image)))


def test_decode_image_jpeg_cmyk():
    decoded = decode_image(encode(make_image("CMYK"), "JPEG"), max_bytes=1 << 20)
    assert decoded.mode == "RGB" and decoded.size == (123, 77)


def test_decode_image_applies_exif_orientation():
    image = make_rgb(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue(), max_bytes=1 << 20).size == (20, 40)


@pytest.mark.parametrize(
    ("data", "kwargs", "match"),
    [
        (b"", {}, "empty"),
        (b"this is not an image at all", {}, "not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {}, "not an image"),
        (b"x" * 2048, {"max_bytes": 1024}, "limit is 1024 bytes"),
    ],
)
def test_decode_image_rejects_bad_bytes(data, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        decode_image(data, **{"max_bytes": 1 << 20, **kwargs})
    assert info.value.param == "image"


def test_decode_image_rejects_truncated_data():
    data = encode(make_rgb(200, 200))
    with pytest.raises(InvalidRequestError, match="truncated or corrupt|not an image"):
        decode_image(data[: len(data) // 2], max_bytes=1 << 20)


def test_decode_image_rejects_too_many_pixels():
    with pytest.raises(InvalidRequestError, match="the limit is 10000"):
        decode_image(encode(make_rgb(200, 100)), max_bytes=1 << 20, max_pixels=10_000)


def test_content_hash_is_sha256_of_compressed_bytes():
    data = encode(make_rgb(64, 48))
    assert content_hash(data) == hashlib.sha256(data).hexdigest()
    assert content_hash(data) != content_hash(encode(make_rgb(64, 48, seed=1)))


def test_pixel_hash_ignores_container_format(processor):
    image = make_rgb(64, 48)
    png = decode_image(encode(image, "PNG"), max_bytes=1 << 20)
    bmp = decode_image(encode(image, "BMP"), max_bytes=1 << 20)
    assert content_hash(encode(image, "PNG")) != content_hash(encode(image, "BMP"))
    assert pixel_hash(processor.preprocess(png)) == pixel_hash(processor.preprocess(bmp))


# --- image_size: decode_image's size from the header ------------------------------------------


def with_exif(image: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, exif=exif)
    return buffer.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    import zlib

    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def png_with_late_exif(image: Image.Image, orientation: int) -> bytes:
    """A PNG whose eXIf chunk follows its pixel data (PIL sees it only when it decodes)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image)
    iend = data.rindex(b"IEND") - 4
    return data[:iend] + png_chunk(b"eXIf", exif.tobytes()) + data[iend:]


def xmp_jpeg(image: Image.Image, orientation: int) -> bytes:
    buffer = io.BytesIO()
    xmp = f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'.encode()
    image.save(buffer, format="JPEG", xmp=xmp)
    return buffer.getvalue()


IMAGE = make_rgb(60, 24)
SIZE_CASES = {
    **{f"jpeg-exif-{o}": with_exif(IMAGE, "JPEG", o) for o in range(1, 9)},
    "jpeg-xmp-6": xmp_jpeg(IMAGE, 6),
    "webp-exif-8": with_exif(IMAGE, "WEBP", 8),
    "png": encode(IMAGE),
    "png-exif-6": with_exif(IMAGE, "PNG", 6),
    "png-late-exif-6": png_with_late_exif(IMAGE, 6),
    "png-cut-before-iend": encode(IMAGE)[:-12],
    "gif": encode(IMAGE.quantize(colors=16), "GIF"),
    "bmp": encode(IMAGE, "BMP"),
    "tiff-exif-5": with_exif(IMAGE, "TIFF", 5),
}


@pytest.mark.parametrize("name", sorted(SIZE_CASES))
def test_image_size_is_decode_images_size(name):
    data = SIZE_CASES[name]
    decoded = decode_image(data, max_bytes=1 << 20)
    assert image_size(data, max_bytes=1 << 20) == (decoded.height, decoded.width)


def test_the_orientations_that_transpose_swap_the_size():
    for orientation in range(1, 9):
        size = image_size(SIZE_CASES[f"jpeg-exif-{orientation}"], max_bytes=1 << 20)
        assert size == ((60, 24) if orientation >= 5 else (24, 60))
    assert decode_image(SIZE_CASES["png-late-exif-6"], max_bytes=1 << 20).size == (24, 60)


@pytest.mark.parametrize(
    ("data", "kwargs", "match"),
    [
        (b"", {}, "empty"),
        (b"this is not an image at all", {}, "not an image"),
        (b"x" * 2048, {"max_bytes": 1024}, "limit is 1024 bytes"),
        (encode(make_rgb(200, 100)), {"max_pixels": 10_000}, "the limit is 10000"),
        (encode(make_rgb(64, 64))[:200], {}, "truncated or corrupt"),  # a PNG cut in its pixel data
    ],
    ids=["empty", "not-an-image", "too-many-bytes", "too-many-pixels", "cut-png"],
)
def test_image_size_refuses_what_decode_image_refuses(data, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        image_size(data, **{"max_bytes": 1 << 20, **kwargs})
    with pytest.raises(InvalidRequestError, match=match):
        decode_image(data, **{"max_bytes": 1 << 20, **kwargs})


def test_a_jpeg_cut_in_its_pixel_data_has_a_size_but_no_decode():
    data = encode(make_rgb(200, 150), "JPEG")
    cut = data[: len(data) // 2]
    assert image_size(cut, max_bytes=1 << 20) == (150, 200)  # the tokenizer reads the header only
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        decode_image(cut, max_bytes=1 << 20)  # the encoder refuses it (INVALID_ARGUMENT, a 400)


@pytest.mark.parametrize("name", ["jpeg-exif-6", "jpeg-xmp-6", "webp-exif-8", "png", "png-exif-6"])
def test_image_size_decodes_no_pixels_where_the_header_says_everything(name, monkeypatch):
    def no_decode(self):
        raise AssertionError("decoded the pixels")

    expected = image_size(SIZE_CASES[name], max_bytes=1 << 20)
    monkeypatch.setattr(Image.Image, "load", no_decode)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert image_size(SIZE_CASES[name], max_bytes=1 << 20) == expected
    with pytest.raises(AssertionError, match="decoded the pixels"):  # the trap works
        decode_image(SIZE_CASES[name], max_bytes=1 << 20)


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


# --- decode_pixels: decode_image's pixels, JPEGs by simplejpeg ---------------------------------


def jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def corrupted(data: bytes) -> bytes:
    """``data`` with bytes of its entropy-coded middle overwritten (libjpeg warns or fails)."""
    middle = len(data) * 2 // 3
    return data[:middle] + bytes(16) + data[middle + 16 :]


PIXEL_CASES = {
    **{
        f"jpeg-{w}x{h}-sub{sub}-q{q}": jpeg(make_rgb(w, h, seed=w), subsampling=sub, quality=q)
        for w, h in [(123, 77), (8, 8), (17, 33), (640, 480)]
        for sub in (0, 1, 2)  # 4:4:4, 4:2:2, 4:2:0
        for q in (50, 95)
    },
    "jpeg-progressive": jpeg(make_rgb(99, 61), progressive=True, quality=90),
    "jpeg-optimized": jpeg(make_rgb(99, 61), optimize=True),
    "jpeg-restart-markers": jpeg(make_rgb(99, 61), restart_marker_blocks=3),
    "jpeg-gray": jpeg(make_rgb(57, 31).convert("L")),
    "jpeg-cmyk": jpeg(make_image("CMYK")),
    **{f"jpeg-exif-{o}": with_exif(make_rgb(60, 24), "JPEG", o) for o in range(1, 9)},
    "jpeg-xmp-6": xmp_jpeg(make_rgb(60, 24), 6),
    "jpeg-corrupt": corrupted(jpeg(make_rgb(200, 120), quality=95)),
    "jpeg-trailing-bytes": jpeg(make_rgb(40, 30)) + b"trailing",
    "jpeg-bytes-before-eoi": jpeg(make_rgb(40, 30))[:-2] + b"\x00\x01\x02\xff\xd9",
    "jpeg-cut-before-eoi": jpeg(make_rgb(200, 120))[:-2],
    "png": encode(make_rgb(33, 21)),
    "webp-exif-8": with_exif(make_rgb(60, 24), "WEBP", 8),
}


@pytest.mark.parametrize("name", sorted(PIXEL_CASES))
def test_decode_pixels_equals_decode_image(name):
    """The encoder's decode (simplejpeg for JPEG) gives PIL's pixels, or PIL's error."""
    data = PIXEL_CASES[name]
    try:
        expected = np.asarray(decode_image(data, max_bytes=1 << 22))
    except InvalidRequestError as exc:
        with pytest.raises(InvalidRequestError) as info:
            decode_pixels(data, max_bytes=1 << 22)
        assert (info.value.message, info.value.param) == (exc.message, exc.param)
        return
    pixels = decode_pixels(data, max_bytes=1 << 22)
    assert pixels.dtype == np.uint8 and pixels.shape == expected.shape
    assert np.array_equal(pixels, expected)


def test_decode_pixels_uses_simplejpeg_for_rgb_and_gray_jpegs_only(monkeypatch):
    import services.engine.processing.image as image_module

    calls = []
    real = image_module.simplejpeg.decode_jpeg

    def counting(data, **kwargs):
        calls.append(kwargs)
        return real(data, **kwargs)

    monkeypatch.setattr(image_module.simplejpeg, "decode_jpeg", counting)
    for name in ("jpeg-123x77-sub2-q95", "jpeg-gray", "jpeg-exif-6"):
        decode_pixels(PIXEL_CASES[name], max_bytes=1 << 22)
    assert calls == [{"colorspace": "RGB"}] * 3
    for name in ("jpeg-cmyk", "png", "webp-exif-8"):
        decode_pixels(PIXEL_CASES[name], max_bytes=1 << 22)
    assert len(calls) == 3


def test_decode_pixels_refuses_what_decode_image_refuses():
    data = jpeg(make_rgb(200, 200))
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        decode_pixels(data[: len(data) // 2], max_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match="the limit is 10000"):
        decode_pixels(data, max_bytes=1 << 20, max_pixels=10_000)
    with pytest.raises(InvalidRequestError, match="limit is 1024 bytes"):
        decode_pixels(data, max_bytes=1024)
