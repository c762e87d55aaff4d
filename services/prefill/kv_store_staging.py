"""The staging buffers of one ``KvStore`` (``kv_store.py``): one registered buffer per kind of
transfer (put, get), and their retirement.

A native call whose result does not confirm the transfer finished (e.g. ``TRANSFER_FAIL``
when the worker holding the page died) retires that kind's buffer for the life of the
process and registers a fresh one: a failed transfer may still touch registered memory after
the binding returns. After ``MAX_RETIRED_BUFFERS`` retirements the client refuses further
calls (its native client and buffers are then kept alive for good too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from services.prefill.kv_store_calls import (
    CONFIRMING,
    BoundedCalls,
    KvStoreError,
    KvStoreUnavailableError,
    StagingBuffer,
    code_name,
)

logger = logging.getLogger(__name__)

MAX_RETIRED_BUFFERS = 4  # staging buffers given up to unconfirmed transfers before refusing
_RETIRED: list[Any] = []  # buffers (and broken clients) kept alive until the process exits


class StagingBuffers:
    """The ``put`` and ``get`` staging buffers (``shape``, ``dtype``) of native client
    ``store``, whose calls are ``calls``. Raises ``KvStoreUnavailableError`` when a buffer
    cannot be registered."""

    def __init__(
        self, store: Any, calls: BoundedCalls, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self._store, self._calls = store, calls
        self._shape, self._dtype = shape, dtype
        self._buffers: dict[str, StagingBuffer] = {}
        self._num_retired = 0
        for what in ("put", "get"):
            self._buffers[what] = self._new(what)

    def __getitem__(self, what: str) -> StagingBuffer:
        """``what``'s buffer now (a retirement replaces it)."""
        return self._buffers[what]

    def native(self, what: str, names: list[str], call: Callable[[], list[int]]) -> list[int]:
        """``call`` (a batch put or get through ``what``'s staging buffer); its per-key codes.
        A result that leaves the transfer unconfirmed retires that buffer first."""
        try:
            codes = list(call())
        except BaseException:
            self._retire(what, "the binding raised")
            raise
        if len(codes) != len(names):
            self._retire(what, f"{len(codes)} results for {len(names)} keys")
            raise KvStoreUnavailableError(
                f"mooncake {what} returned {len(codes)} results for {len(names)} keys"
            )
        unconfirmed = [c for c in codes if c < 0 and c not in CONFIRMING]
        if unconfirmed:
            self._retire(what, code_name(unconfirmed[0]))
        return codes

    def release(self) -> None:
        """Unregister the buffers and leave the store, once no call is in flight."""
        refusing = self._calls.refusing
        if refusing is not None and refusing.startswith("broken"):
            return  # its client and buffers stay alive in _RETIRED
        for staging in self._buffers.values():  # retired ones stay registered and alive
            self._store.unregister_buffer(staging.ptr)
        rc = self._store.close()
        if rc != 0:
            logger.warning("mooncake store close returned %s", code_name(rc))

    def _retire(self, what: str, why: str) -> None:
        """Keep ``what``'s staging buffer registered and alive for good (a failed transfer may
        still touch it) and register a fresh one, or refuse calls past the limit."""
        _RETIRED.append(self._buffers[what])
        self._num_retired += 1
        if self._num_retired > MAX_RETIRED_BUFFERS:
            self._calls.refuse(
                f"broken ({self._num_retired} transfers left unconfirmed, last: {why})"
            )
            _RETIRED.append(self._store)
            logger.error("KV store client %s: refusing further calls", self._calls.refusing)
            return
        logger.warning(
            "mooncake %s left its transfer unconfirmed (%s): its staging buffer is retired",
            what,
            why,
        )
        try:
            self._buffers[what] = self._new(what)
        except KvStoreError as exc:
            self._calls.refuse(f"broken ({exc})")

    def _new(self, what: str) -> StagingBuffer:
        return StagingBuffer(self._store, self._shape, self._dtype, what)
