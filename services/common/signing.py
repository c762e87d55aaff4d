"""HMAC-SHA256 over canonical encodings: how a service binds what it issues to the internal secret.

A MAC covers a purpose (which kind of statement it is, so one MAC never passes for
another) and a tuple of fields, encoded with msgspec msgpack: one tuple has one
encoding, the same on every host. The key is the internal secret
(``Envs.internal_token``), read once at start-up and passed down; an empty secret gives
an empty key, which anyone can reproduce: the explicit insecure mode.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

NONCE_BYTES = 16  # 128 random bits
KV_REF = "kv-ref"  # decode issued this KvRef
KV_WRITTEN = "kv-written"  # prefill wrote the KV of (request_id, nonce)


def key_of(secret: str) -> bytes:
    """The HMAC key of the internal secret (its UTF-8 bytes; empty for an empty secret)."""
    return secret.encode()


def sign(key: bytes, purpose: str, fields: tuple[object, ...]) -> bytes:
    """HMAC-SHA256 of msgpack ``(purpose, *fields)``: 32 bytes."""
    message = msgspec.msgpack.encode((purpose, *fields))
    return hmac.new(key, message, hashlib.sha256).digest()


def verify(key: bytes, purpose: str, fields: tuple[object, ...], mac: bytes) -> bool:
    """Whether ``mac`` is ``sign(key, purpose, fields)``, compared in constant time."""
    return hmac.compare_digest(sign(key, purpose, fields), mac)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def kv_written_proof(key: bytes, request_id: str, nonce: bytes) -> bytes:
    """What prefill returns once the KV of the reservation (``request_id``, ``nonce``) landed."""
    return sign(key, KV_WRITTEN, (request_id, nonce))
