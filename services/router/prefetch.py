"""The encoder starts on a request's images while the request is still on its way to prefill.

Prefill asks the vision encoder for a request's image rows when its Prefill call arrives:
after tokenization, admission, the Reserve on decode and the hop to prefill, and the image's
decode and ViT, the longer part, would only start then. ``ImagePrefetcher`` sends the images to the
encoder as a ``cache_only`` Encode (rows into the owner ranks' caches, written nowhere) in
the background: prefill's own Encode then finds the rows cached, or queues behind this call
and finds them when it ends. The prefetch changes no result: prefill's call writes the rows
either way, and a prefetch that fails (or an image evicted since) leaves prefill's call to
encode it as before.

Two moments. ``start_from_headers``, before tokenization, when the request would be
admitted at once: each image whose header tells its size goes with the grid the router
computes from the checkpoint's image processor (the encoder checks it against the image's
own, so a wrong one fails only the prefetch), so the encoder has the image before the
tokenizer is done. ``start``, once the request is tokenized and
holds its admission ticket, sends the images not sent already.

Only with exactly one ready encoder: which encoder a prefill worker calls is that worker's
own flag (``--encoder-address``), which the router does not see. The encoder client
remembers the images it got cached (``SentHashes``), so an image repeated across requests
is prefetched once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.errors import StageServeError
from services.common.types import ImageHeader, ImageSpanRef, TokenizedPrompt
from services.engine.processing.image import ImageProcessor
from services.router.workers import WorkerKind

logger = logging.getLogger(__name__)


class ImagePrefetcher:
    def __init__(
        self,
        registry: Any,
        spawn: Callable[[Any, str], Any],
        *,
        is_enabled: bool = True,
        processor: ImageProcessor | None = None,
    ) -> None:
        """``registry``: the router's ``WorkerRegistry``; ``spawn(coro, name)`` runs a
        background task the pipeline tracks; ``processor``: the checkpoint's image processor,
        for the grids of ``start_from_headers`` (None: that one sends nothing)."""
        self._registry = registry
        self._spawn = spawn
        self.is_enabled = is_enabled
        self._processor = processor

    def start(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        timeout_s: float,
        sent: frozenset[str] = frozenset(),
    ) -> bool:
        """Start the cache_only Encode of ``prompt``'s images but those whose hash is in
        ``sent``; False when none was started."""
        spans = [s for s in prompt.spans if s.content_hash not in sent]
        return bool(self._start(request_id, spans, prompt.images, timeout_s))

    def start_from_headers(
        self,
        request_id: str,
        images: Sequence[bytes],
        headers: Sequence[ImageHeader | None],
        timeout_s: float,
    ) -> frozenset[str]:
        """Before tokenization: start the cache_only Encode of each image (its bytes, in
        prompt order) whose header was read (``headers[i]``, None where not), with the grid
        of its size. The hashes of the images sent (empty when none was started)."""
        if self._processor is None:
            return frozenset()
        spans: list[ImageSpanRef] = []
        by_hash: dict[str, bytes] = {}
        for data, header in zip(images, headers, strict=True):
            if header is None:
                continue
            grid = self._processor.grid_for_size(header.height, header.width)
            length = self._processor.num_image_tokens(grid)
            spans.append(ImageSpanRef(0, length, header.content_hash, grid))  # offset unused
            by_hash[header.content_hash] = data
        return self._start(request_id, spans, by_hash, timeout_s)

    def _start(
        self,
        request_id: str,
        spans: Sequence[ImageSpanRef],
        images: Mapping[str, bytes],
        timeout_s: float,
    ) -> frozenset[str]:
        if not self.is_enabled or not spans or not images:
            return frozenset()
        encoders = self._registry.ready_workers(WorkerKind.ENCODER)
        if len(encoders) != 1 or encoders[0].client is None:
            return frozenset()
        call = self._cache(encoders[0], request_id, spans, images, timeout_s)
        self._spawn(call, f"prefetch-{request_id}")
        return frozenset(s.content_hash for s in spans)

    async def _cache(
        self,
        encoder: Any,
        request_id: str,
        spans: Sequence[ImageSpanRef],
        images: Mapping[str, bytes],
        timeout_s: float,
    ) -> None:
        try:
            await encoder.client.cache(request_id, spans, images, timeout_s)
        except StageServeError as exc:  # prefill's own Encode still encodes the images
            logger.info("prefetching the images of %s failed: %s", request_id, exc.message)
