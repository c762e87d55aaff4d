"""A rank's embedding cache: image embedding rows keyed by content hash, LRU under a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheEntry:
    rows: torch.Tensor  # [num_image_tokens, embedding_row_width], owns its storage
    grid_thw: tuple[int, int, int]

    @property
    def num_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class EmbeddingCacheManager:
    """Single owner of cached embeddings; evicts the least recently used to fit ``budget_bytes``.

    Thread-safe. ``lookup_entry`` refreshes recency; ``contains`` (for manifests) does not.
    An entry larger than the whole budget is not cached.
    Every eviction is logged until ``take_evicted`` hands the log over (the rank reports it
    to the leader's ledger); ``clear`` logs nothing.
    """

    def __init__(self, budget_bytes: int) -> None:
        assert budget_bytes >= 0
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # oldest first
        self._num_bytes = 0
        self._evicted: list[str] = []
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def contains(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._entries

    def lookup_entry(self, content_hash: str) -> CacheEntry | None:
        """The cached entry (do not modify its rows), marked most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(content_hash)
            if entry is not None:
                self._entries.move_to_end(content_hash)
            return entry

    def can_insert(self, num_bytes: int) -> bool:
        """True when an entry of ``num_bytes`` fits the budget (after evicting others if needed)."""
        return num_bytes <= self.budget_bytes

    def insert(
        self, content_hash: str, rows: torch.Tensor, grid_thw: tuple[int, int, int] = (0, 0, 0)
    ) -> bool:
        """Cache ``rows`` (a private copy when they share storage) under ``content_hash``;
        False when they are larger than the whole budget."""
        rows = rows if _owns_storage(rows) else rows.clone()
        entry = CacheEntry(rows, tuple(grid_thw))
        if not self.can_insert(entry.num_bytes):
            return False
        with self._lock:
            old = self._entries.pop(content_hash, None)
            if old is not None:
                self._num_bytes -= old.num_bytes
            while self._num_bytes + entry.num_bytes > self.budget_bytes:
                evicted_hash, evicted = self._entries.popitem(last=False)
                self._num_bytes -= evicted.num_bytes
                self._evicted.append(evicted_hash)
            self._entries[content_hash] = entry
            self._num_bytes += entry.num_bytes
        return True

    def take_evicted(self) -> list[str]:
        """The hashes evicted since the last call, oldest first."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._num_bytes = 0


def _owns_storage(rows: torch.Tensor) -> bool:
    return (
        rows.is_contiguous()
        and rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()
    )
