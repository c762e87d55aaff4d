"""Paged KV cache: the page manager, the pool tensors, and per-request page tables.

A page holds ``page_size`` consecutive KV positions of one request. Position ``p`` of
a request lives in page ``pages[p // page_size]`` at offset ``p % page_size``; its flat
slot id is ``page * page_size + offset``. ``KVPageManager`` is the only owner of the
free list; ``RequestPageTable`` holds pages on behalf of requests and returns them.

``KVPool`` converts between the model's K and V and its pages: an FP8 pool
(``--kv-cache-dtype fp8_e4m3``) stores ``value / scale`` in e4m3, one scale per layer for K and
one for V (``KVScales``), and gives back ``page * scale``. Everything that moves pages (the KV
handoff, the prefix cache's tiers) moves them as stored, by the pool's ``dtype``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.errors import CapacityError
from services.engine import fp8, ops
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, FP8_E4M3, KV_CACHE_DTYPE_CHOICES


class KVPageManager:
    """Owns the free KV pages; every allocation and free goes through it."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_heap: list[int] = list(range(num_pages))  # min-heap: lowest ids first
        self._is_free = [True] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_heap)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_heap)

    def can_allocate(self, num_pages: int) -> bool:
        """True when ``num_pages`` pages can be allocated right now."""
        return 0 <= num_pages <= len(self._free_heap)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages, lowest ids first; ``CapacityError`` if short (nothing taken)."""
        assert num_pages >= 0
        if not self.can_allocate(num_pages):
            raise CapacityError(
                f"need {num_pages} KV pages, only {len(self._free_heap)} of {self.num_pages} free"
            )
        pages = [heapq.heappop(self._free_heap) for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return ``pages`` to the free list; each must be allocated and listed once."""
        assert len(set(pages)) == len(pages), f"duplicate pages in free: {pages}"
        for page in pages:
            assert 0 <= page < self.num_pages, f"unknown KV page {page}"
            assert not self._is_free[page], f"double free of KV page {page}"
        for page in pages:
            self._is_free[page] = True
            heapq.heappush(self._free_heap, page)


# (shape, dtype) -> zeroed contiguous K and V buffers of that shape on the pool's device, wherever
# the
# allocator keeps them (the shm transfer backend maps them from a file in /dev/shm)
KVAllocator = Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVScales:
    """An FP8 pool's scales, one fp32 per layer for K and one for V: a page holds
    ``value / scale`` (clamped to e4m3's +-448), read back as ``page * scale``."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        assert len(self.k) == len(self.v), (len(self.k), len(self.v))
        for scale in (*self.k, *self.v):
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"a KV cache scale must be positive and finite, got {scale}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        """The scales without calibrated ones in the checkpoint (what vLLM uses then)."""
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


def pool_scales(
    kv_cache_dtype: str, checkpoint: KVScales | None, num_layers: int, device: torch.device
) -> KVScales | None:
    """A pool's scales under ``--kv-cache-dtype``: None for ``auto`` (pages in the model's
    dtype); for ``fp8_e4m3`` the checkpoint's, else 1.0 each. ``ValueError`` for another name
    or a device that cannot hold FP8 pages (``fp8.check_fp8_kv_device``)."""
    if kv_cache_dtype == AUTO_KV_CACHE_DTYPE:
        return None
    if kv_cache_dtype != FP8_E4M3:
        raise ValueError(
            f"unsupported --kv-cache-dtype {kv_cache_dtype!r}; supported: "
            f"{', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    fp8.check_fp8_kv_device(device)
    return checkpoint or KVScales.ones(num_layers)


class KVPool:
    """K and V tensors of every layer, each one contiguous buffer (one memory region per K and V)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        head_start: int = 0,
        scales: KVScales | None = None,
    ) -> None:
        """``dtype``: the model's K and V (what ``write`` takes and attention computes in); the
        pages hold them in it, or with ``scales`` (one per layer) in FP8 e4m3.
        ``head_start``: the model's first KV head this pool holds (a tensor-parallel rank
        holds ``num_kv_heads`` of them from there; 0 for the whole model)."""
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_start = head_start
        self.head_dim = head_dim
        self.value_dtype = dtype
        self.dtype = dtype if scales is None else fp8.FP8_DTYPE  # what the pages hold
        self.device = torch.device(device)
        self.scales = scales  # None: the pages hold the model's dtype
        if scales is not None:
            assert len(scales.k) == num_layers, (len(scales.k), num_layers)
            self._k_scales = torch.tensor(scales.k, dtype=torch.float32, device=self.device)  # [L]
            self._v_scales = torch.tensor(scales.v, dtype=torch.float32, device=self.device)  # [L]
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self._set_buffers(
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def _set_buffers(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
        self.k_buffer = k_buffer  # [L, P, S, Hkv, D]
        self.v_buffer = v_buffer  # [L, P, S, Hkv, D]
        self.k_cache = list(self.k_buffer.unbind(0))  # L x [P, S, Hkv, D], views into k_buffer
        self.v_cache = list(self.v_buffer.unbind(0))  # L x [P, S, Hkv, D], views into v_buffer

    def reallocate(self, allocator: KVAllocator) -> None:
        """Move K and V into buffers from ``allocator``, contents kept; the old buffers are dropped.

        For a transfer backend that owns the pool's memory (``shm``), at registration: before
        anything but this pool holds views of the buffers (a CUDA graph, another thread).
        """
        shape = tuple(self.k_buffer.shape)
        k_buffer, v_buffer = allocator(shape, self.dtype)
        for new in (k_buffer, v_buffer):
            assert new.shape == shape and new.dtype == self.dtype and new.device == self.device
            assert new.is_contiguous()
        k_buffer.copy_(self.k_buffer)
        v_buffer.copy_(self.v_buffer)
        self._set_buffers(k_buffer, v_buffer)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of one layer in one of K or V."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.k_buffer.element_size()

    def memory_regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the K and V buffers, for registration with a transfer engine."""
        return [
            (buf.data_ptr(), buf.numel() * buf.element_size())
            for buf in (self.k_buffer, self.v_buffer)
        ]

    def k_slots(self, layer_id: int) -> torch.Tensor:
        return self.k_cache[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def v_slots(self, layer_id: int) -> torch.Tensor:
        return self.v_cache[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def write(
        self,
        layer_id: int,
        slots: torch.Tensor,  # [num_tokens] int64
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        """Store row ``i`` of ``k``/``v`` at flat slot ``slots[i]`` of layer ``layer_id``
        (quantized with the layer's scales in an FP8 pool)."""
        assert k.shape == v.shape and k.shape[0] == slots.shape[0]
        slots = slots.to(device=self.device, dtype=torch.long)
        k_slots, v_slots = self.k_slots(layer_id), self.v_slots(layer_id)
        if self.scales is None:
            ops.store_kv(k_slots, v_slots, slots, k.to(self.dtype), v.to(self.dtype))
            return
        scales = (self._k_scales[layer_id], self._v_scales[layer_id])
        ops.store_kv(k_slots, v_slots, slots, k, v, scales)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[len(slots), num_kv_heads, head_dim]`` at ``slots`` (int64, on the pool's
        device) of layer ``layer_id``: as the pages hold them, or from an FP8 pool in fp32
        (``page * scale``)."""
        k, v = self.k_slots(layer_id)[slots], self.v_slots(layer_id)[slots]
        if self.scales is None:
            return k, v
        k_scale, v_scale = self._k_scales[layer_id], self._v_scales[layer_id]
        return fp8.dequantize_scaled(k, k_scale), fp8.dequantize_scaled(v, v_scale)

    def store_target(
        self, layer_id: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(k_slots, v_slots, slots)`` for a kernel that copies the model's K and V into the
        pages itself (the rotary kernel, ``ops.rotary_qk``); None for an FP8 pool, whose
        ``write`` quantizes them."""
        if self.scales is not None:
            return None
        return self.k_slots(layer_id), self.v_slots(layer_id), slots


class RequestPageTable:
    """Maps ``request_id`` to the KV pages it holds; pages come from and go back to the manager."""

    def __init__(self, manager: KVPageManager) -> None:
        self.manager = manager
        self.page_size = manager.page_size
        self._pages: dict[str, list[int]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def num_pages_needed(self, request_id: str, total_len: int) -> int:
        assert total_len >= 0
        num_held = len(self._pages.get(request_id, ()))
        return max(0, -(-total_len // self.page_size) - num_held)

    def can_reserve(self, request_id: str, total_len: int) -> bool:
        """True when ``request_id`` can be grown to cover ``total_len`` positions right now."""
        return self.manager.can_allocate(self.num_pages_needed(request_id, total_len))

    def reserve(self, request_id: str, total_len: int) -> list[int]:
        """Grow ``request_id``'s pages to cover ``total_len`` positions; returns the new pages.

        Raises ``CapacityError`` and changes nothing when the manager is short.
        """
        new_pages = self.manager.allocate(self.num_pages_needed(request_id, total_len))
        self._pages.setdefault(request_id, []).extend(new_pages)
        return new_pages

    def adopt(self, request_id: str, pages: list[int]) -> None:
        """Start ``request_id`` on ``pages`` its caller owns (cached KV it reads, positions
        ``[0, len(pages) * page_size)``); ``reserve`` grows it past them, and ``detach``
        hands them back (``release`` would free them)."""
        assert request_id not in self._pages, f"{request_id} already holds pages"
        self._pages[request_id] = list(pages)

    def pages(self, request_id: str) -> list[int]:
        """The pages of ``request_id``, in position order (a copy)."""
        return list(self._pages[request_id])

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (int64, CPU) of positions ``[start, end)`` of ``request_id``."""
        pages = self._pages[request_id]
        assert 0 <= start <= end <= len(pages) * self.page_size, (
            f"positions [{start}, {end}) outside the {len(pages)} pages of {request_id}"
        )
        positions = torch.arange(start, end, dtype=torch.long)
        page_ids = torch.tensor(pages, dtype=torch.long)[positions // self.page_size]
        return page_ids * self.page_size + positions % self.page_size

    def release(self, request_id: str) -> None:
        """Free every page of ``request_id``; a no-op for an unknown request."""
        pages = self.detach(request_id)
        if pages:
            self.manager.free(pages)

    def detach(self, request_id: str) -> list[int]:
        """Forget ``request_id`` and hand its pages to the caller, still allocated; [] when unknown.

        The caller owns them from now on and returns them with ``manager.free``.
        """
        return self._pages.pop(request_id, [])
