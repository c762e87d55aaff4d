"""Image URLs of chat requests to compressed image bytes.

``data:image/...;base64,`` URLs are decoded; ``http(s)`` URLs are fetched by an
``ImageFetcher`` (public addresses only unless allowed, redirects capped, a byte limit
and one total deadline). The bytes must be an image file PIL recognizes (only the
header is read here; the tokenizer and the vision encoder decode the pixels).
"""

from __future__ import annotations

import binascii
import io
import logging

from PIL import Image, UnidentifiedImageError

from services.common.errors import InvalidRequestError
from services.router.b64 import b64decode_strict
from services.router.config import LimitsConfig
from services.router.image_fetch import GuardedBackend, ImageFetcher

logger = logging.getLogger(__name__)


class ImageLoader:
    def __init__(self, max_image_bytes: int, fetcher: ImageFetcher) -> None:
        self._max_image_bytes = max_image_bytes
        self._fetcher = fetcher

    @classmethod
    def from_limits(
        cls, limits: LimitsConfig, backend: GuardedBackend | None = None
    ) -> ImageLoader:
        """A loader with the limits' image flags; ``backend`` replaces the real network (tests)."""
        backend = backend or GuardedBackend(limits.allow_private_image_urls)
        fetcher = ImageFetcher(
            backend,
            max_image_bytes=limits.max_image_bytes,
            timeout_s=limits.image_fetch_timeout_s,
            max_redirects=limits.max_image_redirects,
        )
        return cls(limits.max_image_bytes, fetcher)

    async def load(self, url: str, param: str) -> bytes:
        """The image bytes ``url`` names; ``InvalidRequestError`` (on ``param``) when it names no usable image."""
        if url.startswith("data:"):
            data = self._from_data_url(url, param)
        elif url.startswith(("http://", "https://")):
            data = await self._fetcher.fetch(url, param)
        else:
            raise InvalidRequestError(
                "image_url must be a data: URL or an http(s) URL", param=param
            )
        check_image(data, self._max_image_bytes, param)
        return data

    def _from_data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url.partition(",")
        media_type = header[len("data:") :].split(";")[0].strip().lower()
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError(
                "image data URLs must be base64: data:image/<type>;base64,<data>", param=param
            )
        if media_type and not media_type.startswith("image/"):
            raise InvalidRequestError(
                f"image data URL has media type {media_type!r}, not image/*", param=param
            )
        # base64 grows data by 4/3; refuse before decoding what is certainly too large.
        if len(payload) > (self._max_image_bytes + 2) // 3 * 4 + 4:
            raise self._too_large(param)
        try:
            return b64decode_strict(payload)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(
                f"image data URL is not valid base64: {exc}", param=param
            ) from exc

    def _too_large(self, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"the image is larger than the limit of {self._max_image_bytes} bytes", param=param
        )

    async def close(self) -> None:
        await self._fetcher.close()


def check_image(data: bytes, max_image_bytes: int, param: str) -> None:
    """``InvalidRequestError`` unless ``data`` is an image file of at most ``max_image_bytes``.

    The messages never quote PIL's (they name Python objects, e.g. ``<_io.BytesIO ...>``).
    """
    if len(data) > max_image_bytes:
        raise InvalidRequestError(
            f"the image is larger than the limit of {max_image_bytes} bytes", param=param
        )
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
            "the image bytes are not an image in a format this server reads (PNG, JPEG, GIF, "
            "WebP, ...)",
            param=param,
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        logger.debug("image header of %s refused: %s", param, exc)
        raise InvalidRequestError("the image header is truncated or corrupt", param=param) from None
