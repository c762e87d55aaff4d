"""Strict base64 decoding of request fields (image data URLs, ``prompt_embeds``).

``pybase64`` (SIMD) decodes large data URLs many times faster than the standard library, on
the router's event loop. Input it refuses is decoded again by the
standard library, which either accepts it as before or raises its more precise message
("Incorrect padding", ...), so what is accepted and what an error says are unchanged.
A caller's ``max_bytes`` is checked from the text's length, before anything is decoded.
"""

from __future__ import annotations

import base64
import binascii

import pybase64


class Base64TooLargeError(Exception):
    """The text decodes to more than the caller's ``max_bytes`` (nothing was decoded)."""


def min_decoded_len(text: str) -> int:
    """The fewest bytes ``text`` can decode to when it is valid (padded) base64."""
    return max(0, len(text) // 4 * 3 - 2)


def b64decode_strict(text: str, max_bytes: int | None = None) -> bytes:
    """The bytes ``text`` encodes (standard alphabet, padded, nothing else); ``binascii.Error``
    or ``ValueError`` (non-ASCII input) when it is not such base64; ``Base64TooLargeError``
    when it would decode to more than ``max_bytes``."""
    if max_bytes is not None and min_decoded_len(text) > max_bytes:
        raise Base64TooLargeError(f"{min_decoded_len(text)} bytes or more, over {max_bytes}")
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return base64.b64decode(text, validate=True)
