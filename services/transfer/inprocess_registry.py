"""``session_id`` -> the memory an in-process receiver registered (a KV pool, an embedding buffer).

Receivers take a fresh ``session_id``, register their memory under it and put it in the
destinations they hand out; senders of the same process look it up to copy into it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Generic, TypeVar

from services.common.errors import UnavailableError

T = TypeVar("T")


class InProcessRegistry(Generic[T]):
    """``session_id`` -> registered object, shared by the senders and receivers of one process."""

    def __init__(self, id_prefix: str, kind: str) -> None:
        self._objects: dict[str, T] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._id_prefix = id_prefix  # session ids are "<id_prefix>-<n>"
        self._kind = kind  # what is registered, for the error message ("KV pool")

    def new_session_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

    def register(self, session_id: str, obj: T) -> None:
        with self._lock:
            assert session_id not in self._objects, f"{session_id} already registered"
            self._objects[session_id] = obj

    def unregister(self, session_id: str) -> None:
        with self._lock:
            self._objects.pop(session_id, None)

    def get(self, session_id: str) -> T:
        """The object registered as ``session_id``; ``UnavailableError`` when none is."""
        with self._lock:
            obj = self._objects.get(session_id)
        if obj is None:
            raise UnavailableError(f"no in-process {self._kind} registered as {session_id}")
        return obj
