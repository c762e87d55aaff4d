"""Image URLs of chat requests to compressed image bytes.

``data:image/...;base64,`` URLs are decoded; ``http(s)`` URLs are fetched with a byte
limit and a timeout. The bytes must be an image file PIL recognizes (only the header
is read here; the tokenizer and the vision encoder decode the pixels).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging

import httpx
from PIL import Image, UnidentifiedImageError

from services.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class ImageLoader:
    def __init__(self, max_image_bytes: int, fetch_timeout_s: float, http: httpx.AsyncClient | None = None) -> None:
        self._max_image_bytes = max_image_bytes
        self._fetch_timeout_s = fetch_timeout_s
        self._http = http or httpx.AsyncClient(follow_redirects=True)

    async def load(self, url: str, param: str) -> bytes:
        """The image bytes ``url`` names; ``InvalidRequestError`` (on ``param``) when it names no usable image."""
        if url.startswith("data:"):
            data = self._from_data_url(url, param)
        elif url.startswith(("http://", "https://")):
            data = await self._fetch(url, param)
        else:
            raise InvalidRequestError("image_url must be a data: URL or an http(s) URL", param=param)
        check_image(data, self._max_image_bytes, param)
        return data

    def _from_data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url.partition(",")
        media_type = header[len("data:"):].split(";")[0].strip().lower()
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError("image data URLs must be base64: data:image/<type>;base64,<data>", param=param)
        if media_type and not media_type.startswith("image/"):
            raise InvalidRequestError(f"image data URL has media type {media_type!r}, not image/*", param=param)
        # base64 grows data by 4/3; refuse before decoding what is certainly too large.
        if len(payload) > (self._max_image_bytes + 2) // 3 * 4 + 4:
            raise self._too_large(param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"image data URL is not valid base64: {exc}", param=param) from exc

    async def _fetch(self, url: str, param: str) -> bytes:
        chunks: list[bytes] = []
        size = 0
        try:
            async with self._http.stream("GET", url, timeout=self._fetch_timeout_s) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"fetching the image failed: HTTP {response.status_code}", param=param)
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self._max_image_bytes:
                        raise self._too_large(param)
                    chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise InvalidRequestError(f"fetching the image failed: {type(exc).__name__}: {exc}", param=param) from exc
        return b"".join(chunks)

    def _too_large(self, param: str) -> InvalidRequestError:
        return InvalidRequestError(f"the image is larger than the limit of {self._max_image_bytes} bytes", param=param)

    async def close(self) -> None:
        await self._http.aclose()


def check_image(data: bytes, max_image_bytes: int, param: str) -> None:
    """``InvalidRequestError`` unless ``data`` is an image file of at most ``max_image_bytes``.

    The messages never quote PIL's (they name Python objects, e.g. ``<_io.BytesIO ...>``).
    """
    if len(data) > max_image_bytes:
        raise InvalidRequestError(f"the image is larger than the limit of {max_image_bytes} bytes", param=param)
    if not data:
        raise InvalidRequestError("the image is empty", param=param)
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            image.size  # noqa: B018
    except Image.DecompressionBombError as exc:  # PIL's own limit: over 2 * Image.MAX_IMAGE_PIXELS
        logger.debug("image header of %s refused: %s", param, exc)
        raise InvalidRequestError("the image has too many pixels", param=param) from None
    except UnidentifiedImageError as exc:
        logger.debug("image header of %s refused: %s", param, exc)
        raise InvalidRequestError(
            "the image bytes are not an image in a format this server reads (PNG, JPEG, GIF, WebP, ...)",
            param=param,
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        logger.debug("image header of %s refused: %s", param, exc)
        raise InvalidRequestError("the image header is truncated or corrupt", param=param) from None
