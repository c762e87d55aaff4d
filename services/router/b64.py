"""Strict base64 decoding of request fields (image data URLs, ``prompt_embeds``).

``pybase64`` (SIMD) decodes a 1080p JPEG's 2.5 MB data URL in ~0.13 ms where the standard
library takes ~5 ms on the router's event loop. Input it refuses is decoded again by the
standard library, which either accepts it as before or raises its more precise message
("Incorrect padding", ...), so what is accepted and what an error says are unchanged.
"""

from __future__ import annotations

import base64
import binascii

import pybase64


def b64decode_strict(text: str) -> bytes:
    """The bytes ``text`` encodes (standard alphabet, padded, nothing else); ``binascii.Error``
    or ``ValueError`` (non-ASCII input) when it is not such base64."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return base64.b64decode(text, validate=True)
