"""The content hashes a peer has received bytes for, most recently used last (a bounded LRU).

A client sends an image's bytes to a peer that keeps images (the vision encoder, a prefill
worker) only until a call with them succeeded; later calls name the image by its hash
alone. When the peer no longer holds one it says so having done nothing, and the client
forgets those hashes and sends the call again with the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

REMEMBERED_IMAGES = 4096  # content hashes remembered per peer (64 bytes each)


class SentHashes:
    def __init__(self, max_hashes: int = REMEMBERED_IMAGES) -> None:
        assert max_hashes > 0, max_hashes
        self._max = max_hashes
        self._hashes: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._hashes

    def remember(self, content_hashes: Iterable[str]) -> None:
        for content_hash in content_hashes:
            self._hashes[content_hash] = None
            self._hashes.move_to_end(content_hash)
        while len(self._hashes) > self._max:
            self._hashes.popitem(last=False)

    def forget(self, content_hashes: Iterable[str]) -> None:
        for content_hash in content_hashes:
            self._hashes.pop(content_hash, None)
