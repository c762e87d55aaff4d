"""The prefix cache's host tier on a rank: KV pages copied out of the device pool into host
memory and back (``prefix_cache.PrefixPages`` moves them when the leader says)."""

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
    run). Copies go on the device's current stream, ordered with the forwards around them."""

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        shape = (num_pages, 2, pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim)
        self.kv = torch.empty(shape, dtype=pool.dtype, pin_memory=pool.device.type == "cuda")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: the lowest free slot first
        self.slots: dict[bytes, int] = {}

    def free(self, keys: Iterable[bytes]) -> None:
        for slot in (self.slots.pop(k, None) for k in keys):
            if slot is not None:
                heapq.heappush(self._free, slot)

    def store(self, keys: Sequence[bytes], k: torch.Tensor, v: torch.Tensor) -> None:
        """``k`` and ``v`` ``[layers, len(keys), ...]`` (on the device) are the pages of
        ``keys``."""
        assert len(keys) <= len(self._free), "the leader spilled past the host tier"
        slots = [heapq.heappop(self._free) for _ in keys]
        pages = torch.stack((k, v)).transpose(0, 2).transpose(1, 2).contiguous()  # [n, 2, L, ...]
        for first, index, length in _runs(slots):
            self.kv[first : first + length].copy_(pages[index : index + length], non_blocking=True)
        self.slots.update(zip(keys, slots, strict=True))

    def take(
        self, keys: Sequence[bytes], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, len(keys), ...]`` of ``keys``' pages on ``device``; their slots
        are free again (a later copy into them is ordered after this one)."""
        slots = [self.slots[k] for k in keys]
        pages = torch.empty((len(keys), *self.kv.shape[1:]), dtype=self.kv.dtype, device=device)
        for first, index, length in _runs(slots):
            pages[index : index + length].copy_(self.kv[first : first + length], non_blocking=True)
        self.free(keys)
        kv = pages.transpose(0, 1).transpose(1, 2)  # [2, L, n, ...]
        return kv[0], kv[1]


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
