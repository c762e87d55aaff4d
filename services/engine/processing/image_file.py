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

import hashlib
import io

import numpy as np
import simplejpeg
from PIL import ExifTags, Image, ImageOps

from services.common.errors import InvalidRequestError
from services.engine.processing.jpeg_rows import BandDecoder

# Errors PIL raises on bytes that are not a (complete) image of a known format.
_PIL_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError)
# Formats whose header (what Image.open reads) holds every orientation source (EXIF, XMP).
_HEADER_COMPLETE_FORMATS = ("JPEG", "MPO", "WEBP")
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
_PNG_SIGNATURE_LEN = 8
_PNG_LATE_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # read only on a full decode after IDAT


def to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def _open_image(data: bytes, max_bytes: int, max_pixels: int | None) -> Image.Image:
    """``Image.open`` (the header only) with the size and pixel limits checked."""
    check_num_bytes(len(data), max_bytes)
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"image has too many pixels: {e}", param="image") from e
    except _PIL_DECODE_ERRORS as e:
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


def decode_image(data: bytes, max_bytes: int, max_pixels: int | None = None) -> Image.Image:
    """Decode compressed image bytes into an RGB image (EXIF orientation applied).

    Raises InvalidRequestError for empty or oversized data, bytes that are not an image
    of a format PIL reads, truncated or corrupt data, and images over ``max_pixels``.
    """
    return _decoded(_open_image(data, max_bytes, max_pixels))


def decode_pixels(
    data: bytes, max_bytes: int, max_pixels: int | None = None, bands: BandDecoder | None = None
) -> np.ndarray:
    """``np.asarray(decode_image(data, ...))``: [H, W, 3] uint8, equal pixels and errors.

    With ``bands``, a sequential colour JPEG is decoded by bands of rows on its threads
    (``jpeg_rows``: PIL's libjpeg, the pixels of one full decode). Else, or when it refuses
    the file, a JPEG that PIL opens as RGB or gray is decoded by simplejpeg straight into the
    array: the same libjpeg-turbo decoder with PIL's settings (accurate DCT, fancy
    upsampling), no pass through PIL's 4-byte pixel storage and back (a 1920x1080 noise JPEG:
    28.8 -> 23.5 ms on the CI machine). Anything else, and any JPEG simplejpeg refuses (its
    strict mode refuses what libjpeg only warns about, such as a file cut short), is
    ``decode_image``'s.
    """
    image = _open_image(data, max_bytes, max_pixels)
    if bands is not None and image.format == "JPEG" and image.mode == "RGB":
        if "progressive" not in image.info:  # a band would decode every scan
            pixels = bands.decode(data, image.width, image.height)
            if pixels is not None:
                return _exif_transposed(pixels, _header_exif(image))
    if image.format == "JPEG" and image.mode in ("RGB", "L"):
        try:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")  # strict: warnings raise
        except ValueError:
            pass
        else:
            if pixels.shape == (image.height, image.width, 3):
                return _exif_transposed(pixels, _header_exif(image))
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
    except _PIL_DECODE_ERRORS as e:
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


def header_size(
    data: bytes, max_bytes: int, max_pixels: int | None = None
) -> tuple[int, int] | None:
    """``image_size`` where the header alone tells it (no pixel decode), else None."""
    image = _open_image(data, max_bytes, max_pixels)
    if image.format == "PNG" and _png_header_is_complete(data):
        exif = Image.Image.getexif(image)  # the base method: PNG's own would decode to look further
    elif image.format in _HEADER_COMPLETE_FORMATS:
        exif = _header_exif(image)
    else:
        return None
    is_transposed = exif.get(ExifTags.Base.Orientation, 1) in _TRANSPOSING_ORIENTATIONS
    return (image.width, image.height) if is_transposed else (image.height, image.width)


def _header_exif(image: Image.Image) -> Image.Exif:
    try:
        return image.getexif()
    except _PIL_DECODE_ERRORS as e:
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
