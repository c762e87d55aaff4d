"""Mooncake Transfer Engine backend: decode registers its pool, prefill writes into it.

Each side owns one ``TransferEngine`` in P2P-handshake mode (no metadata server): the
receiver's ``session_id`` is ``"host:rpc_port"``, and a sender opens the segment on the
first write to it. A request's pages move in one ``batch_transfer_sync_write`` call, or
in a few when its plan exceeds ``max_descriptors_per_call``: the TCP transport queues at
most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024) + ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``
(1024) descriptors per peer and fails a larger batch outright (measured: 2049 pass, 3000 fail).

The engine call blocks (GIL released) until the bytes land, the peer fails, or the
engine's own timeout passes (``MC_TRANSFER_TIMEOUT``; a peer that accepts TCP but never
answers the handshake holds it for about 60 s). ``send`` runs it on a daemon thread and
stops waiting at the request deadline, so a slow peer becomes ``DeadlineExceededError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from services.common.errors import DeadlineExceededError, UnavailableError
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    TransferPlan,
    TransferResult,
    check_deadline,
    plan_transfer,
    pool_layout,
)

_INSTALL_HINT = (
    "install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU) "
    "and libibverbs1 librdmacm1 libnuma1"
)


class MooncakeEngine:
    """One ``mooncake.engine.TransferEngine``; C return codes < 0 become ``UnavailableError``."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the wheel, or a shared library it links (libibverbs, libnuma)
            raise ImportError(f"Mooncake transfer backend unavailable ({exc}): {_INSTALL_HINT}") from exc
        self._engine: Any = TransferEngine()
        _check(
            self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name), "initialize", hostname
        )
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        addrs = [addr for addr, _ in regions]
        _check(
            self._engine.batch_register_memory(addrs, [n for _, n in regions]),
            "register_memory",
            self.session_id,
        )
        self._registered.extend(addrs)

    def unregister_all(self) -> None:
        if self._registered:
            _check(
                self._engine.batch_unregister_memory(self._registered), "unregister_memory", self.session_id
            )
            self._registered = []

    def write(self, peer: str, plan: TransferPlan, max_descriptors: int, stop: threading.Event) -> None:
        """Blocking write of ``plan`` into ``peer``'s registered memory, ``max_descriptors`` per call."""
        for begin in range(0, plan.num_descriptors, max_descriptors):
            if stop.is_set():  # the caller gave up at its deadline: issue no more batches
                return
            end = begin + max_descriptors
            lengths = list(plan.lengths[begin:end])
            rc = self._engine.batch_transfer_sync_write(
                peer, list(plan.src_addrs[begin:end]), list(plan.dst_addrs[begin:end]), lengths
            )
            _check(rc, f"batch write of {sum(lengths)} bytes in {len(lengths)} descriptors", peer)


def _check(rc: int, what: str, peer: str) -> None:
    if rc < 0:
        raise UnavailableError(f"mooncake {what} failed for {peer} (rc={rc})")


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
        self, request_id: str, src_pool: KVPool, src_pages: Sequence[int], dst: KvDestination, deadline: float
    ) -> TransferResult:
        start = time.monotonic()
        plan = plan_transfer(pool_layout(src_pool), src_pages, dst)
        if plan.num_descriptors:
            self.register(src_pool)
            self._write_before(request_id, dst.session_id, plan, deadline)
        return TransferResult(request_id, plan.num_bytes, plan.num_descriptors, time.monotonic() - start)

    def _write_before(self, request_id: str, peer: str, plan: TransferPlan, deadline: float) -> None:
        remaining = check_deadline(request_id, deadline)
        errors: list[BaseException] = []
        done, stop = threading.Event(), threading.Event()

        def run() -> None:
            try:
                self._engine.write(peer, plan, self._max_descriptors, stop)
            except BaseException as exc:  # handed to the waiting caller below
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"kv-send-{request_id}", daemon=True).start()
        if not done.wait(remaining):
            stop.set()
            raise DeadlineExceededError(
                f"KV transfer for {request_id} to {peer} did not finish before its deadline "
                f"({plan.num_bytes} bytes); the peer is slow or unreachable"
            )
        if errors:
            raise errors[0]

    def close(self) -> None:
        with self._lock:
            self._engine.unregister_all()
            self._registered_regions.clear()


class MooncakeKVReceiver(BaseKVReceiver):
    backend = "mooncake"

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", **kwargs: Any
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
