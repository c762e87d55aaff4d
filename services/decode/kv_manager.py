"""Which request holds which KV pages on one decode rank."""

from __future__ import annotations

from services.common.errors import CapacityError
from services.engine.kv_cache import RequestPageTable


class KVReservationManager:
    """The only owner of a decode rank's request -> pages map (over the model runner's page table).

    A request's pages are taken once, at Reserve, for every position it can ever write,
    so a running request never needs more. Not thread-safe: the engine calls it under
    its lock (the model runner only reads the pages of requests in the step it runs).
    """

    def __init__(self, page_table: RequestPageTable) -> None:
        self._table = page_table
        self._manager = page_table.manager

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
        return self._manager.num_used_pages

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
                f"{self.num_total_pages} are free"
            )
        return self._table.reserve(request_id, num_positions)

    def free(self, request_id: str) -> int:
        """Return every page of ``request_id``; the number freed (0 when it holds none)."""
        if request_id not in self._table:
            return 0
        num_pages = len(self._table.pages(request_id))
        self._table.release(request_id)
        return num_pages

    def pages(self, request_id: str) -> list[int]:
        return self._table.pages(request_id)
