"""Mooncake Transfer Engine backend for embedding rows (P2P handshake over TCP or RDMA).

Prefill registers its ``EmbeddingBuffer`` once; its ``session_id`` is ``"host:rpc_port"``.
The encoder copies a request's rows into a staging buffer it registered once (rows
``staging_rows``, allocated per send by an ``EmbeddingRowManager``) and writes every
coalesced run with one ``batch_transfer_sync_write``. A send that does not fit the
staging buffer right now registers its own copy of the rows for that one write.

The engine call blocks (GIL released) until the bytes land, the peer fails, or the
engine's own timeout passes; it runs on a daemon thread and the caller stops waiting at
the deadline (``DeadlineExceededError``). The staging rows of an abandoned write go back
only when the engine call returns, so they are never overwritten while being read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.common.errors import CapacityError, DeadlineExceededError, UnavailableError
from services.transfer.base import TransferPlan, TransferResult
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    EmbeddingRowManager,
    RowRun,
    check_deadline,
    check_rows,
    coalesce_runs,
    plan_row_transfer,
)
from services.transfer.mooncake_backend import MooncakeEngine


class _RowEngine(MooncakeEngine):
    """``MooncakeEngine`` that can also unregister single regions (per-send registrations)."""

    def unregister(self, addrs: Sequence[int]) -> None:
        rc = self._engine.batch_unregister_memory(list(addrs))
        if rc < 0:
            raise UnavailableError(f"mooncake unregister_memory failed for {self.session_id} (rc={rc})")
        self._registered = [a for a in self._registered if a not in set(addrs)]


class MooncakeEmbeddingReceiver(BaseEmbeddingReceiver):
    backend = "mooncake"

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._engine = _RowEngine(hostname, protocol, device_name)

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    def _register_memory(self, buffer: EmbeddingBuffer) -> None:
        self._engine.register([buffer.memory_region()])

    def _unregister_memory(self, buffer: EmbeddingBuffer) -> None:
        del buffer
        self._engine.unregister_all()


class MooncakeEmbeddingSender(BaseEmbeddingSender):
    backend = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        staging_rows: int = 4096,
        max_descriptors_per_call: int = 1024,
    ) -> None:
        assert staging_rows > 0 and max_descriptors_per_call > 0
        self._engine = _RowEngine(hostname, protocol, device_name)
        self._staging_rows = staging_rows
        self._max_descriptors = max_descriptors_per_call
        self._staging: EmbeddingBuffer | None = None
        self._staging_manager = EmbeddingRowManager(staging_rows)
        self._lock = threading.Lock()

    def send_runs(
        self, request_id: str, rows: torch.Tensor, runs: Sequence[RowRun], dst: EmbeddingDestination, deadline: float
    ) -> TransferResult:
        start = time.monotonic()
        check_rows(request_id, rows, runs, dst)
        merged = coalesce_runs(runs)
        if not merged:
            return TransferResult(request_id, 0, 0, time.monotonic() - start)
        check_deadline(request_id, deadline)
        src, release = self._stage(rows)
        try:
            plan = plan_row_transfer(src.data_ptr(), merged, rows.shape[1] * rows.element_size(), dst)
        except BaseException:
            release()
            raise
        self._write_before(request_id, dst.session_id, plan, deadline, release)
        return TransferResult(request_id, plan.num_bytes, plan.num_descriptors, time.monotonic() - start)

    def _stage(self, rows: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A registered copy of ``rows`` and the function that gives its memory back."""
        num_rows = rows.shape[0]
        with self._lock:
            staging = self._staging_for(rows)
            if staging is not None:
                try:
                    first = self._staging_manager.allocate(num_rows)
                except CapacityError:
                    pass
                else:
                    view = staging.rows(first, num_rows)
                    view.copy_(rows)
                    return view, lambda: self._staging_manager.free(first, num_rows)
        own = rows.clone()  # not in staging: register a private copy for this one write
        self._engine.register([(own.data_ptr(), own.numel() * own.element_size())])
        return own, lambda: self._engine.unregister([own.data_ptr()])

    def _staging_for(self, rows: torch.Tensor) -> EmbeddingBuffer | None:
        if self._staging is None:
            self._staging = EmbeddingBuffer(self._staging_rows, rows.shape[1], rows.dtype, rows.device)
            self._engine.register([self._staging.memory_region()])
        staging = self._staging
        same = (staging.hidden_size, staging.dtype, staging.tensor.device) == (rows.shape[1], rows.dtype, rows.device)
        return staging if same else None

    def _write_before(
        self, request_id: str, peer: str, plan: TransferPlan, deadline: float, release: Callable[[], None]
    ) -> None:
        errors: list[BaseException] = []
        done, stop = threading.Event(), threading.Event()

        def run() -> None:
            try:
                self._engine.write(peer, plan, self._max_descriptors, stop)
            except BaseException as exc:  # handed to the waiting caller below
                errors.append(exc)
            finally:
                release()
                done.set()

        try:
            remaining = check_deadline(request_id, deadline)
        except DeadlineExceededError:
            release()
            raise
        threading.Thread(target=run, name=f"embedding-send-{request_id}", daemon=True).start()
        if not done.wait(remaining):
            stop.set()
            raise DeadlineExceededError(
                f"embedding transfer for {request_id} to {peer} did not finish before its deadline "
                f"({plan.num_bytes} bytes); the peer is slow or unreachable"
            )
        if errors:
            raise errors[0]

    def close(self) -> None:
        with self._lock:
            self._engine.unregister_all()
            self._staging = None
