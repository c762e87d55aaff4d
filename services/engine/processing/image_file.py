"""Compressed image files: their limits, their size from the header, their decode, their hash.

Images travel between services as their compressed bytes. The services key images
(embedding cache, owner election) on ``content_hash``: the SHA-256 of those bytes, which
the tokenizer computes without decoding. The tokenizer needs only an image's size:
``image_size`` reads it from the header (no pixel decode where the header says everything).
The vision encoder needs pixels: ``decode_pixels`` (JPEGs by bands of rows on several threads,
``jpeg_rows``, or by simplejpeg, with PIL's pixels either way), or ``decode_image`` for a PIL
image (the offline engine, transformers' path).

Colour conversion follows ``transformers`` 5.17 (``convert_to_rgb``): any non-RGB mode
goes through PIL's ``Image.convert("RGB")``. For RGBA and LA that drops alpha without
compositing on a background: a fully transparent pixel keeps its stored colour.
"""

from __future__ import annotations

import numpy as np
import simplejpeg
from PIL import ExifTags, Image, ImageOps

from services.common.errors import InvalidRequestError
from services.common.image_header import (
    PIL_DECODE_ERRORS,
    check_num_bytes,
    check_num_pixels,
    content_hash,
    header_exif,
    header_size,
    open_image,
)
from services.engine.processing.jpeg_rows import BandDecoder

__all__ = [
    "check_num_bytes",
    "check_num_pixels",
    "content_hash",
    "decode_image",
    "decode_pixels",
    "header_size",
    "image_size",
    "to_rgb",
]


def to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(data: bytes, max_bytes: int, max_pixels: int | None = None) -> Image.Image:
    """Decode compressed image bytes into an RGB image (EXIF orientation applied).

    Raises InvalidRequestError for empty or oversized data, bytes that are not an image
    of a format PIL reads, truncated or corrupt data, and images over ``max_pixels``.
    """
    return _decoded(open_image(data, max_bytes, max_pixels))


def decode_pixels(
    data: bytes, max_bytes: int, max_pixels: int | None = None, bands: BandDecoder | None = None
) -> np.ndarray:
    """``np.asarray(decode_image(data, ...))``: [H, W, 3] uint8, equal pixels and errors.

    With ``bands``, a sequential colour JPEG is decoded by bands of rows on its threads
    (``jpeg_rows``: PIL's libjpeg, the pixels of one full decode). Else, or when it refuses
    the file, a JPEG that PIL opens as RGB or gray is decoded by simplejpeg straight into the
    array: the same libjpeg-turbo decoder with PIL's settings (accurate DCT, fancy
    upsampling), no pass through PIL's 4-byte pixel storage and back. Anything else, and any
    JPEG simplejpeg refuses (its
    strict mode refuses what libjpeg only warns about, such as a file cut short), is
    ``decode_image``'s.
    """
    image = open_image(data, max_bytes, max_pixels)
    if bands is not None and image.format == "JPEG" and image.mode == "RGB":
        if "progressive" not in image.info:  # a band would decode every scan
            pixels = bands.decode(data, image.width, image.height)
            if pixels is not None:
                return _exif_transposed(pixels, header_exif(image))
    if image.format == "JPEG" and image.mode in ("RGB", "L"):
        try:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")  # strict: warnings raise
        except ValueError:
            pass
        else:
            if pixels.shape == (image.height, image.width, 3):
                return _exif_transposed(pixels, header_exif(image))
    return np.asarray(_decoded(image))


# ImageOps.exif_transpose's turn for each EXIF orientation, on [H, W, C] arrays.
_ORIENTATION_TURNS = {
    2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda a: a[::-1, ::-1],  # ROTATE_180
    4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
    5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],  # ROTATE_270 (clockwise)
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # TRANSVERSE
    8: lambda a: a.transpose(1, 0, 2)[::-1],  # ROTATE_90 (counter-clockwise)
}


def _exif_transposed(pixels: np.ndarray, exif: Image.Exif) -> np.ndarray:
    """``ImageOps.exif_transpose``'s turn of ``pixels`` by the EXIF (or XMP) orientation."""
    turn = _ORIENTATION_TURNS.get(exif.get(ExifTags.Base.Orientation, 1))
    return pixels if turn is None else np.ascontiguousarray(turn(pixels))


def _decoded(image: Image.Image) -> Image.Image:
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # no copy of an image it need not turn
    except PIL_DECODE_ERRORS as e:
        raise InvalidRequestError(f"image data is truncated or corrupt: {e}", param="image") from e
    return to_rgb(image)


def image_size(data: bytes, max_bytes: int, max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) of ``decode_image(data, ...)``, from the header where it says everything.

    JPEG, MPO and WebP headers carry every orientation source; a PNG's do unless metadata
    follows its pixel data. Any other file, or a PNG whose chunks are cut or corrupt, is
    decoded in full, so the size and the errors are ``decode_image``'s. Pixel data that is
    cut short or corrupt after an intact header is found only by the decode (the encoder's).
    """
    size = header_size(data, max_bytes, max_pixels)
    if size is None:
        decoded = decode_image(data, max_bytes, max_pixels)
        return decoded.height, decoded.width
    return size
