"""The compressed bytes of the images recent Prefill calls brought, by content hash.

A router sends an image's bytes to a prefill worker only until a call with them succeeded
(``PrefillClient``): later calls name the image by its hash alone, and the worker takes its
bytes from here to hand the encoder if the encoder no longer holds the image. A call that
names an image neither sent nor held fails with ``ImageDataNeededError`` before anything
else happens (its KvRef still unused), and the router sends it again with the bytes. The
store keeps the most recently used images up to ``max_bytes``. Bytes are stored as sent:
the encoder checks every image's hash against its bytes when it gets them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from services.common.errors import ImageDataNeededError


class ImageStore:
    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, max_bytes
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._images: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._images)

    def resolve(self, content_hashes: Iterable[str], sent: Mapping[str, bytes]) -> dict[str, bytes]:
        """The bytes of every image in ``content_hashes``: sent with the call, else held here;
        ``ImageDataNeededError`` naming every image that is neither."""
        images, missing = {}, []
        for content_hash in dict.fromkeys(content_hashes):
            data = sent.get(content_hash) or self._images.get(content_hash)
            if data:
                images[content_hash] = data
            else:
                missing.append(content_hash)
        if missing:
            names = ", ".join(missing)
            raise ImageDataNeededError(
                f"this prefill worker does not hold image(s) {names}: send their bytes",
                param="images",
            )
        for content_hash in images:
            if content_hash in self._images:
                self._images.move_to_end(content_hash)
        return images

    def put(self, images: Mapping[str, bytes]) -> None:
        """Hold ``images`` (most recently used), dropping the least recently used over the bound;
        an image larger than the whole store is not held."""
        for content_hash, data in images.items():
            if content_hash in self._images or not data or len(data) > self.max_bytes:
                continue
            self._images[content_hash] = data
            self.num_bytes += len(data)
        while self.num_bytes > self.max_bytes:
            _, dropped = self._images.popitem(last=False)
            self.num_bytes -= len(dropped)
