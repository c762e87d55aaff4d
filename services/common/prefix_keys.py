"""Page keys of a prompt: what the prefix cache and cache-aware routing match prompts on.

The key of a prompt's page ``i`` (tokens ``[i * page_size, (i + 1) * page_size)``) is the
SHA-256 of the key of page ``i - 1``, the page's token ids, and, for every image span that
overlaps the page, the image's content hash (SHA-256 of its bytes), its patch grid and
where the span starts relative to the page; truncated to ``KEY_BYTES``. A key therefore
names the page together with everything before it: two prompts share page ``i``'s key
only when their first ``i + 1`` pages hold the same tokens and the same images. An
image's placeholder tokens are the same for every image, so the image's full content
hash is what tells two images apart: a different image after the same text changes
every key from the first page holding its tokens on, and equal image bytes after the
same prefix give equal keys. Only full pages have keys.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from services.common.types import ImageSpanRef

KEY_BYTES = 16  # 128 bits: an accidental collision between two prompts' pages never happens
_SEED = b"stageserve-prefix-keys-v1"
_IMAGE = struct.Struct("<I3Iqi")  # hash length, grid (t, h, w), span start - page start, length


def page_keys(
    token_ids: Sequence[int], spans: Sequence[ImageSpanRef], page_size: int
) -> list[bytes]:
    """The keys of the prompt's full pages, in order (``len(token_ids) // page_size`` of them)."""
    assert page_size > 0
    tokens = array("I", token_ids)
    assert tokens.itemsize == 4
    if sys.byteorder == "big":
        tokens.byteswap()
    data = tokens.tobytes()
    parent = hashlib.sha256(_SEED + page_size.to_bytes(4, "little")).digest()[:KEY_BYTES]
    keys: list[bytes] = []
    span_index = 0
    for page in range(len(token_ids) // page_size):
        start, end = page * page_size, (page + 1) * page_size
        digest = hashlib.sha256(parent)
        digest.update(data[4 * start : 4 * end])
        while (
            span_index < len(spans) and spans[span_index].offset + spans[span_index].length <= start
        ):
            span_index += 1  # spans are in prompt order: those wholly before this page are done
        for span in spans[span_index:]:
            if span.offset >= end:
                break
            image_hash = span.content_hash.encode()
            digest.update(
                _IMAGE.pack(len(image_hash), *span.grid_thw, span.offset - start, span.length)
            )
            digest.update(image_hash)
        parent = digest.digest()[:KEY_BYTES]
        keys.append(parent)
    return keys
