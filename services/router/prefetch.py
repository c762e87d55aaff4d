"""The encoder starts on a request's images while the request is still on its way to prefill.

Today prefill asks the vision encoder for a request's image rows when its Prefill call
arrives: after tokenization, admission, the Reserve on decode and the hop to prefill (about
17 ms for a cached 1920x1080 image on one H200, 30 ms with its 1.9 MB sent along), and the
image's decode and ViT (~88 ms) only start then. ``ImagePrefetcher.start`` sends the images
to the encoder as a ``cache_only`` Encode (rows into the owner ranks' caches, written
nowhere) as soon as the request is tokenized and holds its admission ticket, in the
background: prefill's own Encode then finds the rows cached, or queues behind this call and
finds them when it ends. The prefetch changes no result: prefill's call writes the rows
either way, and a prefetch that fails (or an image evicted since) leaves prefill's call to
encode it as before.

Only with exactly one ready encoder: which encoder a prefill worker calls is that worker's
own flag (``--encoder-address``), which the router does not see. The encoder client
remembers the images it got cached (``SentHashes``), so an image repeated across requests
is prefetched once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.common.errors import StageServeError
from services.common.types import TokenizedPrompt
from services.router.workers import WorkerKind

logger = logging.getLogger(__name__)


class ImagePrefetcher:
    def __init__(
        self, registry: Any, spawn: Callable[[Any, str], Any], *, is_enabled: bool = True
    ) -> None:
        """``registry``: the router's ``WorkerRegistry``; ``spawn(coro, name)`` runs a
        background task the pipeline tracks."""
        self._registry = registry
        self._spawn = spawn
        self.is_enabled = is_enabled

    def start(self, request_id: str, prompt: TokenizedPrompt, timeout_s: float) -> bool:
        """Start the cache_only Encode of ``prompt``'s images; False when none was started."""
        if not self.is_enabled or not prompt.spans or not prompt.images:
            return False
        encoders = self._registry.ready_workers(WorkerKind.ENCODER)
        if len(encoders) != 1 or encoders[0].client is None:
            return False
        call = self._cache(encoders[0], request_id, prompt, timeout_s)
        self._spawn(call, f"prefetch-{request_id}")
        return True

    async def _cache(
        self, encoder: Any, request_id: str, prompt: TokenizedPrompt, timeout_s: float
    ) -> None:
        try:
            await encoder.client.cache(request_id, prompt.spans, prompt.images, timeout_s)
        except StageServeError as exc:  # prefill's own Encode still encodes the images
            logger.info("prefetching the images of %s failed: %s", request_id, exc.message)
