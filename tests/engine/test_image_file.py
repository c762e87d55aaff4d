"""Compressed image files (``image_file``) against PIL: decode, the size from the header, the
limits and errors, the content hash, and ``decode_pixels``' simplejpeg path."""

from __future__ import annotations

import hashlib
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image, ImageFile

from services.common.errors import InvalidRequestError
from services.engine.processing import jpeg_rows
from services.engine.processing.image_file import (
    content_hash,
    decode_image,
    decode_pixels,
    image_size,
    to_rgb,
)
from tests.engine.image_helpers import encode, make_image, make_rgb


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


@pytest.fixture(scope="module")
def band_decoder():
    """``jpeg_rows``' decoder on 4 threads: built wherever a C compiler and PIL's libjpeg are."""
    if shutil.which("cc") is None or jpeg_rows.pil_libjpeg() is None:
        pytest.skip("no C compiler, or a PIL without its own libjpeg: the bands are not built")
    with ThreadPoolExecutor(4) as pool:
        decoder = jpeg_rows.load_band_decoder(pool, 4)
        assert decoder is not None, "cc and PIL's libjpeg are here: the build must succeed"
        yield decoder


@pytest.mark.parametrize("with_bands", [False, True], ids=["one-thread", "bands"])
@pytest.mark.parametrize("name", sorted(PIXEL_CASES))
def test_decode_pixels_equals_decode_image(name, with_bands, request):
    """The encoder's decode (bands of rows or simplejpeg for JPEG) gives PIL's pixels, or
    PIL's error."""
    bands = request.getfixturevalue("band_decoder") if with_bands else None
    data = PIXEL_CASES[name]
    try:
        expected = np.asarray(decode_image(data, max_bytes=1 << 22))
    except InvalidRequestError as exc:
        with pytest.raises(InvalidRequestError) as info:
            decode_pixels(data, max_bytes=1 << 22, bands=bands)
        assert (info.value.message, info.value.param) == (exc.message, exc.param)
        return
    pixels = decode_pixels(data, max_bytes=1 << 22, bands=bands)
    assert pixels.dtype == np.uint8 and pixels.shape == expected.shape
    assert np.array_equal(pixels, expected)


def test_decode_pixels_uses_simplejpeg_for_rgb_and_gray_jpegs_only(monkeypatch):
    import services.engine.processing.image_file as image_module

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
