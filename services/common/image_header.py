"""The header of a compressed image file: its limits, its size, its hash; no pixel decode.

The services key images (embedding cache, owner election) on ``content_hash``: the SHA-256
of the compressed bytes. ``header_size`` reads an image's size from its header where the
header says everything (orientation included); ``services.engine.processing.image_file``
decodes pixels on top of ``open_image``. Callers that only size images (the tokenizer
client, the router) need nothing above ``services.common``.
"""

from __future__ import annotations

import hashlib
import io

from PIL import ExifTags, Image

from services.common.errors import InvalidRequestError

# Errors PIL raises on bytes that are not a (complete) image of a known format.
PIL_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError)
# Formats whose header (what Image.open reads) holds every orientation source (EXIF, XMP).
_HEADER_COMPLETE_FORMATS = ("JPEG", "MPO", "WEBP")
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
_PNG_SIGNATURE_LEN = 8
_PNG_LATE_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # read only on a full decode after IDAT


def open_image(data: bytes, max_bytes: int, max_pixels: int | None) -> Image.Image:
    """``Image.open`` (the header only) with the size and pixel limits checked."""
    check_num_bytes(len(data), max_bytes)
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"image has too many pixels: {e}", param="image") from e
    except PIL_DECODE_ERRORS as e:
        raise InvalidRequestError(
            "image data is not an image in a supported format "
            "(PNG, JPEG, GIF, WebP, BMP, TIFF, ...)",
            param="image",
        ) from e
    check_num_pixels(image.width, image.height, max_pixels)
    return image


def check_num_bytes(num_bytes: int, max_bytes: int) -> None:
    """InvalidRequestError for an empty image file or one over ``max_bytes``."""
    if not num_bytes:
        raise InvalidRequestError("image data is empty", param="image")
    if num_bytes > max_bytes:
        raise InvalidRequestError(
            f"image is {num_bytes} bytes; the limit is {max_bytes} bytes", param="image"
        )


def check_num_pixels(width: int, height: int, max_pixels: int | None) -> None:
    """InvalidRequestError for an image over ``max_pixels`` (None: no limit)."""
    num_pixels = width * height
    if max_pixels is not None and num_pixels > max_pixels:
        raise InvalidRequestError(
            f"image is {width}x{height} = {num_pixels} pixels; the limit is {max_pixels}",
            param="image",
        )


def header_size(
    data: bytes, max_bytes: int, max_pixels: int | None = None
) -> tuple[int, int] | None:
    """``image_size`` where the header alone tells it (no pixel decode), else None."""
    image = open_image(data, max_bytes, max_pixels)
    if image.format == "PNG" and _png_header_is_complete(data):
        exif = Image.Image.getexif(image)  # the base method: PNG's own would decode to look further
    elif image.format in _HEADER_COMPLETE_FORMATS:
        exif = header_exif(image)
    else:
        return None
    is_transposed = exif.get(ExifTags.Base.Orientation, 1) in _TRANSPOSING_ORIENTATIONS
    return (image.width, image.height) if is_transposed else (image.height, image.width)


def header_exif(image: Image.Image) -> Image.Exif:
    try:
        return image.getexif()
    except PIL_DECODE_ERRORS as e:
        raise InvalidRequestError(f"image data is truncated or corrupt: {e}", param="image") from e


def _png_header_is_complete(data: bytes) -> bool:
    """Whether the chunks are whole up to IEND and no metadata chunk follows the first IDAT."""
    pos, is_past_pixels = _PNG_SIGNATURE_LEN, False
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + length  # length, type, data, CRC
        if end > len(data):
            return False
        if kind == b"IEND":
            return True
        if kind == b"IDAT":
            is_past_pixels = True
        elif is_past_pixels and kind in _PNG_LATE_METADATA:
            return False
        pos = end
    return False


def content_hash(data: bytes) -> str:
    """SHA-256 hex of the compressed image bytes: the key the services use for an image."""
    return hashlib.sha256(data).hexdigest()
