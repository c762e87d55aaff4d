"""In-process backend: prefill and decode pools live in one process; pages move by tensor copies.

Receivers publish their pool on an ``InProcessFabric`` under their ``session_id``;
senders sharing that fabric look the pool up and copy each page run of every layer of
K and V with one slice copy per run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from services.common.errors import UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    TransferResult,
    check_compatible,
    check_deadline,
    page_runs,
    pool_layout,
)
from services.transfer.inprocess_registry import InProcessRegistry


class InProcessFabric(InProcessRegistry[KVPool]):
    """``session_id`` -> registered decode pool, for the senders and receivers of one process."""

    def __init__(self) -> None:
        super().__init__(id_prefix="inprocess", kind="KV pool")


_DEFAULT_FABRIC = InProcessFabric()  # used when a caller wires one process without passing a fabric


class InProcessKVSender(BaseKVSender):
    backend = "inprocess"

    def __init__(self, fabric: InProcessFabric | None = None) -> None:
        self._fabric = fabric or _DEFAULT_FABRIC

    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> TransferResult:
        start = time.monotonic()
        heads = check_compatible(pool_layout(src_pool), src_pages, dst)
        check_deadline(request_id, deadline_mono)
        dst_pool = self._fabric.get(dst.session_id)
        if dst_pool.k_buffer.data_ptr() != dst.layout.k_base:
            raise UnavailableError(
                f"{dst.session_id} re-registered a different pool since {request_id} started"
            )
        runs = page_runs(src_pages, dst.page_ids)
        for src_page, dst_page, num_pages in runs:
            for src_buf, dst_buf in (
                (src_pool.k_buffer, dst_pool.k_buffer),
                (src_pool.v_buffer, dst_pool.v_buffer),
            ):
                # [L, num_pages, S, Hkv, D]: every layer of one run in one copy
                if heads is not None:  # the heads both pools hold, of every page
                    src_buf, dst_buf = src_buf[:, :, :, heads[0]], dst_buf[:, :, :, heads[1]]
                dst_buf[:, dst_page : dst_page + num_pages].copy_(
                    src_buf[:, src_page : src_page + num_pages]
                )
        num_bytes = 2 * src_pool.num_layers * len(src_pages) * src_pool.page_nbytes
        return TransferResult(request_id, num_bytes, 2 * len(runs), time.monotonic() - start)


class InProcessKVReceiver(BaseKVReceiver):
    backend = "inprocess"

    def __init__(self, fabric: InProcessFabric | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fabric = fabric or _DEFAULT_FABRIC
        self._session_id = self._fabric.new_session_id()

    @property
    def session_id(self) -> str:
        return self._session_id

    def _register_memory(self, pool: KVPool) -> None:
        self._fabric.register(self._session_id, pool)

    def _unregister_memory(self, pool: KVPool) -> None:
        del pool
        self._fabric.unregister(self._session_id)
