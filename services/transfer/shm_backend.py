"""Shared-memory KV backend: prefill writes straight into decode's pool, mapped from /dev/shm.

Decode's receiver moves its pool into one segment at ``register`` (``[K | V]``, each
``[L, P, S, Hkv, D]``; see ``shm_memory`` for how segments are named, guarded and
removed) and publishes ``shm:<name>@<k_base>`` as its ``session_id``. Prefill's sender maps
the segment once and copies each run of pages with one slice copy of every layer of K and
one of V, so nothing listens on a network port and no byte leaves the host's memory.

Writes are one-sided, as with Mooncake: ``send`` returns once the bytes are in decode's
pages, and decode learns it from the request protocol. The deadline is checked before
each run: a write stopped there leaves its earlier runs in the pages, which decode's
quarantine covers as it covers any late write (see base.py). Both processes must run on
one host as the same user; a GPU pool needs ``cuda_ipc``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.common.errors import InvalidRequestError
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    TransferResult,
    check_backend,
    check_compatible,
    check_deadline,
    page_runs,
    pool_layout,
)
from services.transfer.shm_memory import (
    ShmReceiver,
    ShmSegment,
    ShmSender,
    decode_session_id,
    typed_view,
)

POOL = "decode's KV pool"


class ShmKVReceiver(ShmReceiver, BaseKVReceiver):
    """Decode side: the pool's K and V move into a segment at ``register``; ``close`` unlinks it."""

    def _register_memory(self, pool: KVPool) -> None:
        if pool.device.type != "cpu":
            raise ValueError(
                f"the shm KV backend moves host memory and this KV pool is on {pool.device}: "
                "use --kv-transfer-backend cuda_ipc (GPUs of one host)"
            )
        half = pool.k_buffer.numel() * pool.k_buffer.element_size()

        def move(segment: ShmSegment) -> int:
            pool.reallocate(
                lambda shape, dtype: (
                    typed_view(segment.tensor, 0, shape, dtype, POOL),
                    typed_view(segment.tensor, half, shape, dtype, POOL),
                )
            )
            return pool.k_buffer.data_ptr()

        self._own_segment("kv", 2 * half, POOL, move)


class ShmKVSender(ShmSender, BaseKVSender):
    """Prefill side: maps each decode pool once (LRU of ``max_peers``), then copies page runs."""

    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> TransferResult:
        start = time.monotonic()
        check_backend(request_id, self.backend, dst)
        heads = check_compatible(pool_layout(src_pool), src_pages, dst)
        check_deadline(request_id, deadline_mono)
        dst_k, dst_v = self._pool_of(dst)
        src_k, src_v = src_pool.k_buffer, src_pool.v_buffer
        if heads is not None:  # [L, P, S, Hkv, D]: the heads both pools hold, of every page
            src_heads, dst_heads = heads
            src_k, src_v = src_k[:, :, :, src_heads], src_v[:, :, :, src_heads]
            dst_k, dst_v = dst_k[:, :, :, dst_heads], dst_v[:, :, :, dst_heads]
        runs = page_runs(src_pages, dst.page_ids)
        for src_page, dst_page, num_pages in runs:
            check_deadline(request_id, deadline_mono)
            src, dst_run = (
                slice(src_page, src_page + num_pages),
                slice(dst_page, dst_page + num_pages),
            )
            # [L, num_pages, S, Hkv, D]: every layer of one run in one copy, for K and for V
            dst_k[:, dst_run].copy_(src_k[:, src])
            dst_v[:, dst_run].copy_(src_v[:, src])
        num_bytes = 2 * src_pool.num_layers * len(src_pages) * src_pool.page_nbytes
        return TransferResult(request_id, num_bytes, 2 * len(runs), time.monotonic() - start)

    def _pool_of(self, dst: KvDestination) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode's K and V (``[L, P, S, Hkv, D]`` each) mapped here, checked by ``dst.layout``."""
        ref = decode_session_id(dst.session_id)
        layout = dst.layout
        half = layout.num_layers * layout.num_pages * layout.page_nbytes
        if (layout.k_base, layout.v_base) != (ref.base_address, ref.base_address + half):
            raise InvalidRequestError(
                f"{dst.request_id}: the KV layout does not match the shared pool it names"
            )
        mapping = self._peers.open(ref.name, POOL)
        if mapping.num_bytes != 2 * half:
            raise InvalidRequestError(
                f"{dst.request_id}: the destination layout needs {2 * half} bytes, "
                f"{POOL} has {mapping.num_bytes}"
            )
        dtype = getattr(torch, layout.dtype)  # check_compatible made it this pool's dtype
        shape = (
            layout.num_layers,
            layout.num_pages,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        return (
            typed_view(mapping.tensor, 0, shape, dtype, dst.request_id),
            typed_view(mapping.tensor, half, shape, dtype, dst.request_id),
        )
