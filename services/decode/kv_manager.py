"""Which request holds which KV pages on one decode rank, and which pages rest in quarantine."""

from __future__ import annotations

import math
import time
from collections import deque

from services.common.errors import CapacityError
from services.engine.kv_cache import RequestPageTable
from services.transfer.base import Clock


class KVReservationManager:
    """The only owner of a decode rank's request -> pages map (over the model runner's page table).

    A request's pages are taken once, at Reserve, for every position it can ever write,
    so a running request never needs more. Pages leave a request by ``free`` (back to the
    free list at once) or by ``quarantine``: a reservation whose transfer failed before its
    KV was ready may still receive a late write from an abandoned transfer (Mooncake keeps
    one going until ``MC_TRANSFER_TIMEOUT``), so its pages rest ``quarantine_s`` seconds
    before ``release_quarantined`` returns them. Every page is free, used (held by a
    request) or quarantined. Not thread-safe: the engine calls it under its lock (the model
    runner only reads the pages of requests in the step it runs).
    """

    def __init__(
        self, page_table: RequestPageTable, quarantine_s: float, clock: Clock = time.monotonic
    ) -> None:
        assert quarantine_s >= 0
        self._table = page_table
        self._manager = page_table.manager
        self._quarantine_s = quarantine_s
        self._clock = clock
        self._quarantine: deque[tuple[float, list[int]]] = (
            deque()
        )  # (release time, pages), by release time
        self._num_quarantined = 0

    @property
    def page_size(self) -> int:
        return self._table.page_size

    @property
    def num_total_pages(self) -> int:
        return self._manager.num_pages

    @property
    def num_free_pages(self) -> int:
        return self._manager.num_free_pages

    @property
    def num_used_pages(self) -> int:
        """Pages held by requests (reserved or running); quarantined pages are not counted."""
        return self._manager.num_used_pages - self._num_quarantined

    @property
    def num_quarantined_pages(self) -> int:
        return self._num_quarantined

    def num_pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    def can_allocate(self, num_positions: int) -> bool:
        """True when a new request covering ``num_positions`` KV positions fits right now."""
        return self._manager.can_allocate(self.num_pages_for(num_positions))

    def allocate(self, request_id: str, num_positions: int) -> list[int]:
        """Pages (position order) for ``num_positions`` positions of a new request; ``CapacityError`` if short."""
        assert request_id not in self._table, f"{request_id} already holds pages"
        num_pages = self.num_pages_for(num_positions)
        if not self._manager.can_allocate(num_pages):
            raise CapacityError(
                f"{request_id} needs {num_pages} KV pages, {self.num_free_pages} of "
                f"{self.num_total_pages} are free ({self._num_quarantined} in quarantine)"
            )
        return self._table.reserve(request_id, num_positions)

    def free(self, request_id: str) -> int:
        """Return every page of ``request_id`` to the free list; the number freed (0 when it holds none)."""
        if request_id not in self._table:
            return 0
        num_pages = len(self._table.pages(request_id))
        self._table.release(request_id)
        return num_pages

    def quarantine(self, request_id: str) -> int:
        """Move every page of ``request_id`` to quarantine for ``quarantine_s``; the number moved.

        With ``quarantine_s == 0`` this is ``free``. The request id is forgotten at once
        (it may reserve again); only its pages wait.
        """
        if self._quarantine_s == 0:
            return self.free(request_id)
        pages = self._table.detach(request_id)
        if pages:
            self._quarantine.append((self._clock() + self._quarantine_s, pages))
            self._num_quarantined += len(pages)
        return len(pages)

    def release_quarantined(self) -> int:
        """Return the pages whose quarantine has passed to the free list; the number returned."""
        now, num_released = self._clock(), 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, pages = self._quarantine.popleft()
            self._manager.free(pages)
            num_released += len(pages)
        self._num_quarantined -= num_released
        return num_released

    def seconds_to_release(self) -> float:
        """Until the oldest quarantined pages are due back (inf: none in quarantine)."""
        return self._quarantine[0][0] - self._clock() if self._quarantine else math.inf

    def pages(self, request_id: str) -> list[int]:
        return self._table.pages(request_id)
