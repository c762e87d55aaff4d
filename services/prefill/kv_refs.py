"""Prefill's check of the KvRefs callers hand it, before it connects anywhere or writes a byte.

A KvRef is decode's signed grant of some pages to one request until a deadline
(``services.common.kv_ref.KvRefInfo``). Prefill accepts one only when its MAC
verifies under the internal secret's key, it names the Prefill request's id, it has not
expired, and its nonce was not used before; since the MAC covers the endpoint, prefill
connects only to transfer engines decode itself advertised. After the write landed,
``written_proof`` is what decode wants at Generate.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from services.common import signing
from services.common.errors import CapacityError, InvalidRequestError
from services.common.kv_ref import KvRefInfo


def _unix_ms() -> int:
    return int(time.time() * 1000)


class NonceManager:
    """The nonces of accepted KvRefs, each kept until its KvRef expires; at most ``max_nonces``."""

    def __init__(self, max_nonces: int) -> None:
        assert max_nonces > 0
        self.max_nonces = max_nonces
        self._used: set[bytes] = set()
        self._by_expiry: list[tuple[int, bytes]] = []  # heap of (expires_unix_ms, nonce)

    def __len__(self) -> int:
        return len(self._used)

    def use(self, nonce: bytes, expires_unix_ms: int, now_unix_ms: int) -> None:
        """Record ``nonce``; ``InvalidRequestError`` if in use, ``CapacityError`` when full."""
        while self._by_expiry and self._by_expiry[0][0] <= now_unix_ms:
            self._used.discard(heapq.heappop(self._by_expiry)[1])
        if nonce in self._used:
            raise InvalidRequestError(
                "kv_ref was already used by an earlier Prefill (a replay); "
                "each reservation is written once",
                param="kv_ref",
            )
        if len(self._used) >= self.max_nonces:
            raise CapacityError(
                f"prefill holds {self.max_nonces} live kv_ref nonces (--max-kv-ref-nonces); "
                "retry shortly"
            )
        self._used.add(nonce)
        heapq.heappush(self._by_expiry, (expires_unix_ms, nonce))


class KvRefVerifier:
    """Holds prefill's key; ``verify`` a KvRef before use, ``written_proof`` once its KV landed."""

    def __init__(
        self, key: bytes, max_nonces: int, clock_unix_ms: Callable[[], int] = _unix_ms
    ) -> None:
        self._key = key
        self._clock_unix_ms = clock_unix_ms
        self.nonces = NonceManager(max_nonces)

    def verify(self, kv_ref: KvRefInfo, request_id: str) -> None:
        """``InvalidRequestError`` (param ``kv_ref``) unless decode issued ``kv_ref`` for
        ``request_id``, it is live and unused; then it counts as used."""
        if kv_ref.request_id != request_id:
            raise InvalidRequestError(
                f"kv_ref was issued for request {kv_ref.request_id!r}, not {request_id!r}",
                param="kv_ref",
            )
        if not kv_ref.has_valid_mac(self._key):
            raise InvalidRequestError(
                "kv_ref is not one decode issued "
                "(its MAC does not verify under the internal secret)",
                param="kv_ref",
            )
        now = self._clock_unix_ms()
        if kv_ref.expires_unix_ms <= now:
            raise InvalidRequestError(
                f"kv_ref expired {now - kv_ref.expires_unix_ms} ms ago "
                "(decode has let the reservation go)",
                param="kv_ref",
            )
        self.nonces.use(kv_ref.nonce, kv_ref.expires_unix_ms, now)

    def written_proof(self, kv_ref: KvRefInfo) -> bytes:
        """What decode's Generate wants once ``kv_ref``'s KV landed."""
        return signing.kv_written_proof(self._key, kv_ref.request_id, kv_ref.nonce)
