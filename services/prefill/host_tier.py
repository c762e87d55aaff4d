"""The prefix cache's host tier on a rank: KV pages copied out of the device pool into host
memory and back (``prefix_pages.PrefixPages`` moves them when the leader says)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from services.engine.kv_cache import KVPool


def num_host_pages(host_cache_gb: float, pool: KVPool) -> int:
    """Pages of ``pool`` (K and V of every layer) that ``host_cache_gb`` holds."""
    return int(host_cache_gb * 1e9) // (2 * pool.num_layers * pool.page_nbytes)


class HostTier:
    """A rank's host copies of KV pages and which key each slot holds: one tensor ``[slots, 2
    (K, V), layers, page_size, heads, dim]`` in host memory (pinned when the pool is on a GPU),
    a slot contiguous, so a run of consecutive slots moves as one copy between the device
    and host memory (slots are handed out lowest first, so a batch's slots mostly are one
    run).

    On the CPU every copy is done when the call returns. On a GPU (issue 38: tier moves never
    block a step):

    - ``store`` (a spill) gathers the pages into one fresh device tensor on the current
      stream (device to device; after it the spilled device pages may be overwritten by
      what is queued next, the forward included) and copies that tensor into the pinned slots
      on ``stream``, this tier's side stream, after an event recorded behind the gather: the
      forward queued next does not wait for the copy over PCIe. The gathered tensor is marked
      as used by ``stream`` (``record_stream``): its memory is not handed out again before
      the copy read it.
    - ``take`` (a load) copies the slots into a fresh device tensor on the current stream, in
      order before the forward that reads it.

    Ordering, with every call made from one thread on one current stream (the rank's):

    - load after spill: ``take`` makes the current stream wait for the newest side copy that
      writes one of the slots it reads and may still run (the side stream runs its copies in
      order, so every older one is done then too); slots whose copies finished cost no wait.
      A load never waits for a copy into other slots.
    - spill after load (a slot a ``take`` freed, reused by a later spill): the spill's side
      copy waits for the event recorded on the current stream after its gather, so it starts
      after every load queued before the spill.
    - spill after spill (a slot ``free``d, by a drop or a load, while a copy into it runs,
      then reused): both copies are on the side stream, which runs them in order: the later
      one lands last.
    """

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        shape = (num_pages, 2, pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim)
        on_cuda = pool.device.type == "cuda"
        self.kv = torch.empty(shape, dtype=pool.dtype, pin_memory=on_cuda)
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: the lowest free slot first
        self.slots: dict[bytes, int] = {}
        # the spills' copies into the tier, beside the step's stream (None on the CPU)
        self.stream = torch.cuda.Stream(pool.device) if on_cuda else None
        # side copies that may still run: (the event after it, the slots it writes), oldest first
        self._writes: list[tuple[torch.cuda.Event, frozenset[int]]] = []

    def free(self, keys: Iterable[bytes]) -> None:
        """Their slots are free again (a copy into one still running lands before any later
        copy into it: see the class)."""
        for slot in (self.slots.pop(k, None) for k in keys):
            if slot is not None:
                heapq.heappush(self._free, slot)

    def store(self, keys: Sequence[bytes], k: torch.Tensor, v: torch.Tensor) -> None:
        """``k`` and ``v`` ``[layers, len(keys), ...]`` (on the device) are the pages of
        ``keys``; they are read before this returns in stream order (the gather), so the
        caller may overwrite what they were gathered from at once."""
        assert len(keys) <= len(self._free), "the leader spilled past the host tier"
        slots = [heapq.heappop(self._free) for _ in keys]
        pages = torch.stack((k, v)).transpose(0, 2).transpose(1, 2).contiguous()  # [n, 2, L, ...]
        if self.stream is None:
            self._copy_in(slots, pages)
        else:
            self._copy_in_beside(slots, pages)
        self.slots.update(zip(keys, slots, strict=True))

    def take(
        self, keys: Sequence[bytes], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, len(keys), ...]`` of ``keys``' pages on ``device``, copied on its
        current stream; their slots are free again (a later copy into them is ordered after
        this one)."""
        slots = [self.slots[k] for k in keys]
        pages = torch.empty((len(keys), *self.kv.shape[1:]), dtype=self.kv.dtype, device=device)
        if self.stream is not None:
            self._after_writes(slots, device)
        for first, index, length in _runs(slots):
            pages[index : index + length].copy_(self.kv[first : first + length], non_blocking=True)
        self.free(keys)
        kv = pages.transpose(0, 1).transpose(1, 2)  # [2, L, n, ...]
        return kv[0], kv[1]

    def _copy_in(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        for first, index, length in _runs(slots):
            self.kv[first : first + length].copy_(pages[index : index + length], non_blocking=True)

    def _copy_in_beside(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        """``pages`` (just gathered on the current stream) into ``slots`` on the side stream."""
        assert self.stream is not None
        gathered = torch.cuda.Event()
        gathered.record(torch.cuda.current_stream(pages.device))
        self.stream.wait_event(gathered)
        with torch.cuda.stream(self.stream):
            self._copy_in(slots, pages)
        pages.record_stream(self.stream)  # its memory is reused only after the copy read it
        written = torch.cuda.Event()
        written.record(self.stream)
        self._writes = [w for w in self._writes if not w[0].query()]
        self._writes.append((written, frozenset(slots)))

    def _after_writes(self, slots: Sequence[int], device: torch.device) -> None:
        """``device``'s current stream waits for the side copies into ``slots`` still running."""
        self._writes = [w for w in self._writes if not w[0].query()]
        wanted = set(slots)
        newest = next((e for e, s in reversed(self._writes) if not s.isdisjoint(wanted)), None)
        if newest is not None:
            torch.cuda.current_stream(device).wait_event(newest)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first slot, index in slots, length)`` of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and slot == runs[-1][0] + runs[-1][2]:
            first, at, length = runs[-1]
            runs[-1] = (first, at, length + 1)
        else:
            runs.append((slot, index, 1))
    return runs
