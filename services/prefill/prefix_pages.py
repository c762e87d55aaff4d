"""A prefill rank's side of the prefix cache: its cached pages by key in device memory, its
host tier and the shared KV store, moved, kept and dropped only as the leader's plan says
(``prefix_cache.PrefixIndex`` decides; ``CacheMoves`` carries the decision).

On a GPU a spill's copy to host memory and a store write's copy run on side streams beside
the step (``HostTier``, ``PrefixPages.write_to_store``); loads and fetches are copied in
stream order before the forward that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from services.engine.kv_cache import KVPool, RequestPageTable
from services.prefill.host_tier import HostTier
from services.prefill.messages import CacheMoves


class PageStore(Protocol):
    """The shared KV store as a rank uses it (``kv_store.py``)."""

    def get(self, keys: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, len(keys), page_size, heads, dim]`` on the CPU; raises when any
        is missing or the store fails."""
        ...

    def put_later(
        self,
        keys: Sequence[bytes],
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Write the pages in the background (never blocks on the store). ``ready`` (given
        only on a GPU): ``k`` and ``v`` are host memory a side-stream copy is filling; they
        are read only after this event (the background writer waits on it, not the caller)."""
        ...


class PrefixPages:
    """A rank's cached pages by key, in device memory, (``num_host_pages`` > 0) its host tier
    and (``store``) the KV store shared with other workers; what it keeps, moves and drops is
    the leader's word.

    On a GPU no move makes the step's stream wait for a copy to host memory (issue 38): a
    spill and a store write gather their pages on the current stream (device to device;
    after that the pages may be overwritten, the next forward included) and copy them to
    host memory on a side stream (``HostTier.stream`` for spills, with its ordering rules;
    ``store_stream`` for store writes, whose background writer waits on the copy's event
    before reading). Loads and fetches stay on the current stream before the forward that
    reads them. Page numbers go to the device without a blocking upload (``_index``), so the
    rank's thread does not wait for the GPU either. On the CPU every copy is done when the
    call returns.
    """

    def __init__(
        self,
        table: RequestPageTable,
        pool: KVPool,
        num_host_pages: int = 0,
        store: PageStore | None = None,
    ) -> None:
        self.table, self.pool, self.store = table, pool, store
        self._pages: dict[bytes, int] = {}
        self.host = HostTier(pool, num_host_pages) if num_host_pages else None
        on_cuda = pool.device.type == "cuda"
        # store writes' copies to host memory, beside the step's stream (None: no store or CPU)
        self.store_stream = (
            torch.cuda.Stream(pool.device) if store is not None and on_cuda else None
        )

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def num_host_pages(self) -> int:
        return self.host.num_pages if self.host is not None else 0

    def keys(self) -> frozenset[bytes]:
        return frozenset(self._pages)

    def host_keys(self) -> frozenset[bytes]:
        return frozenset(self.host.slots) if self.host is not None else frozenset()

    def clear(self) -> None:
        self.drop([*self._pages, *self.host_keys()])

    def drop(self, keys: Sequence[bytes]) -> None:
        """Free ``keys`` wherever they are (a key held nowhere is no error)."""
        pages = [p for p in (self._pages.pop(k, None) for k in keys) if p is not None]
        self.table.manager.free(pages)
        if self.host is not None:
            self.host.free(keys)

    def apply(self, moves: CacheMoves) -> None:
        """The leader's moves before a plan: drop; take the loads out of the host tier; spill
        into it; put the loads into device pages (the spills freed them)."""
        self.drop(moves.drop)
        loaded = None
        if moves.load:
            assert self.host is not None, "the leader loaded on a rank with no host tier"
            loaded = self.host.take(moves.load, self.pool.device)
        if moves.spill:
            assert self.host is not None, "the leader spilled to a rank with no host tier"
            pages = [self._pages.pop(k) for k in moves.spill]
            index = self._index(pages)
            # gathered in stream order now; copied to host memory beside the forward (GPU)
            self.host.store(moves.spill, self.pool.k_buffer[:, index], self.pool.v_buffer[:, index])
            self.table.manager.free(pages)
        if loaded is not None:
            self._place(moves.load, *loaded)
        if moves.fetch:
            assert self.store is not None, "the leader fetched on a rank with no KV store"
            self._place(moves.fetch, *self.store.get(moves.fetch))

    def _place(self, keys: Sequence[bytes], k: torch.Tensor, v: torch.Tensor) -> None:
        """New device pages for ``keys`` holding ``k`` and ``v`` (``[layers, len(keys), ...]``)."""
        pages = self.table.manager.allocate(len(keys))
        index = self._index(pages)
        self.pool.k_buffer[:, index] = k.to(self.pool.device, self.pool.dtype)
        self.pool.v_buffer[:, index] = v.to(self.pool.device, self.pool.dtype)
        self._pages.update(zip(keys, pages, strict=True))

    def write_to_store(self, keys: Sequence[bytes]) -> None:
        """Hand ``keys``' device pages (held here) to the store's background writer. On a GPU
        the pages are gathered on the current stream (the caller may overwrite them once this
        returns) and copied to pinned host memory on ``store_stream``; the writer waits on
        that copy's event, this thread never does."""
        assert self.store is not None, "the leader asked a rank with no KV store to write"
        index = self._index([self._pages[k] for k in keys])
        k, v = self.pool.k_buffer[:, index], self.pool.v_buffer[:, index]
        if self.store_stream is None:
            self.store.put_later(keys, k.to("cpu"), v.to("cpu"))
            return
        gathered = torch.cuda.Event()
        gathered.record(torch.cuda.current_stream(self.pool.device))
        self.store_stream.wait_event(gathered)
        k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
        v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        with torch.cuda.stream(self.store_stream):
            k_host.copy_(k, non_blocking=True)
            v_host.copy_(v, non_blocking=True)
        for gather in (k, v):  # their memory is reused only after the copy read it
            gather.record_stream(self.store_stream)
        copied = torch.cuda.Event()
        copied.record(self.store_stream)
        self.store.put_later(keys, k_host, v_host, ready=copied)

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        """Page numbers as an index on the pool's device. On a GPU a non-blocking upload: a
        blocking one (``torch.tensor(..., device=)``) always makes this thread wait until the
        current stream ran everything queued before it (a load's copy, a forward); this one
        does so at most where the driver chooses to (it stages the pageable bytes before the
        call returns), never waits for a side stream, and allocates no pinned memory."""
        if self.pool.device.type != "cuda":
            return torch.tensor(pages, device=self.pool.device)
        return torch.tensor(pages, dtype=torch.long).to(self.pool.device, non_blocking=True)

    def lend(self, request_id: str, prefix_keys: Sequence[bytes], num_tokens: int) -> None:
        """Give ``request_id`` the prefix's pages, then new pages up to ``num_tokens``."""
        self.table.adopt(request_id, [self._pages[k] for k in prefix_keys])
        self.table.reserve(request_id, num_tokens)

    def settle(
        self,
        request_id: str,
        prefix_keys: Sequence[bytes],
        store_keys: Sequence[bytes],
        computed: bool,
    ) -> None:
        """The plan ended: keep ``store_keys``' pages when ``computed`` (their KV is whole),
        free the rest of what ``request_id`` got beyond its prefix."""
        pages = self.table.detach(request_id)[len(prefix_keys) :]
        kept: set[int] = set()
        if computed:
            for key, page in zip(store_keys, pages, strict=False):
                if key not in self._pages:  # a copy computed again (the last page) goes
                    self._pages[key] = page
                    kept.add(page)
        self.table.manager.free([p for p in pages if p not in kept])
