"""Mooncake Transfer Engine backend: decode registers its pool, prefill writes into it.

Each side owns one ``MooncakeEngine`` (P2P handshake, no metadata server; see
``mooncake_engine``): the receiver's ``session_id`` is ``"host:rpc_port"``. A request's
pages move in one ``batch_transfer_sync_write`` call, or in a few when its plan exceeds
``max_descriptors_per_call`` (the TCP transport fails a batch of more than about 2048
descriptors per peer). ``send`` waits for the write until the request deadline, so a
slow peer becomes ``DeadlineExceededError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    TransferResult,
    check_deadline,
    plan_transfer,
    pool_layout,
)
from services.transfer.mooncake_engine import MooncakeEngine


class MooncakeKVSender(BaseKVSender):
    backend = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_descriptors_per_call: int = 1024,
    ) -> None:
        assert max_descriptors_per_call > 0
        self._engine = MooncakeEngine(hostname, protocol, device_name)
        self._max_descriptors = max_descriptors_per_call
        self._registered_regions: set[tuple[tuple[int, int], ...]] = set()
        self._lock = threading.Lock()

    def register(self, pool: KVPool) -> None:
        regions = tuple(pool.memory_regions())
        with self._lock:
            if regions not in self._registered_regions:
                self._engine.register(regions)
                self._registered_regions.add(regions)

    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> TransferResult:
        start = time.monotonic()
        plan = plan_transfer(pool_layout(src_pool), src_pages, dst)
        if plan.num_descriptors:
            self.register(src_pool)
            remaining = check_deadline(request_id, deadline_mono)
            self._engine.write_within(
                dst.session_id,
                plan,
                self._max_descriptors,
                remaining,
                what=f"KV transfer for {request_id}",
                thread_name=f"kv-send-{request_id}",
            )
        return TransferResult(
            request_id, plan.num_bytes, plan.num_descriptors, time.monotonic() - start
        )

    def close(self) -> None:
        with self._lock:
            self._engine.unregister_all()
            self._registered_regions.clear()


class MooncakeKVReceiver(BaseKVReceiver):
    backend = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._engine = MooncakeEngine(hostname, protocol, device_name)

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    def _register_memory(self, pool: KVPool) -> None:
        self._engine.register(pool.memory_regions())

    def _unregister_memory(self, pool: KVPool) -> None:
        del pool
        self._engine.unregister_all()
