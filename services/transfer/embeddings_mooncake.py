"""Mooncake Transfer Engine backend for embedding rows (P2P handshake over TCP or RDMA).

Prefill registers its ``EmbeddingBuffer`` once; its ``session_id`` is ``"host:rpc_port"``.
The encoder copies a request's rows into a staging buffer it registered once (rows
``staging_rows``, allocated per send by an ``EmbeddingRowManager``) and writes every
coalesced run with one ``batch_transfer_sync_write``. A send that does not fit the
staging buffer right now registers its own copy of the rows for that one write.

With the host-only Mooncake build (``mooncake-transfer-engine-non-cuda``) every registered
region is host memory: the encoder stages GPU rows in pinned host memory, and prefill's
buffer lives there too (``buffer_device``), its rows moved to the GPU when a step is built.

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

from services.common.errors import CapacityError
from services.common.kv_transfer import mooncake_moves_device_memory
from services.transfer.base import TransferPlan, TransferResult, check_deadline
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    EmbeddingRowManager,
    RowRun,
    coalesce_runs,
)
from services.transfer.mooncake_engine import MooncakeEngine


def plan_row_transfer(
    src_base: int, runs: Sequence[RowRun], row_nbytes: int, dst: EmbeddingDestination
) -> TransferPlan:
    """Descriptors for ``runs`` of a contiguous source at ``src_base``; one per run if packed."""
    descs: list[tuple[int, int, int]] = []
    for src, dst_row, num_rows in coalesce_runs(runs):
        src_addr = src_base + src * row_nbytes
        dst_addr = dst.base_address + dst_row * dst.row_stride_bytes
        if dst.row_stride_bytes == row_nbytes:
            descs.append((src_addr, dst_addr, num_rows * row_nbytes))
        else:  # padded destination rows: one descriptor per row
            descs.extend(
                (src_addr + i * row_nbytes, dst_addr + i * dst.row_stride_bytes, row_nbytes)
                for i in range(num_rows)
            )
    columns = tuple(zip(*descs, strict=True)) or ((), (), ())
    return TransferPlan(*columns)


class MooncakeEmbeddingReceiver(BaseEmbeddingReceiver):
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

    def buffer_device(self, compute_device: torch.device) -> torch.device:
        return compute_device if mooncake_moves_device_memory() else torch.device("cpu")

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
        self._engine = MooncakeEngine(hostname, protocol, device_name)
        self._staging_rows = staging_rows
        self._max_descriptors = max_descriptors_per_call
        self._staging: EmbeddingBuffer | None = None
        self._staging_manager = EmbeddingRowManager(staging_rows)
        self._lock = threading.Lock()

    def _write_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        merged: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
        start: float,
    ) -> TransferResult:
        src, release = self._stage(rows)
        try:
            plan = plan_row_transfer(
                src.data_ptr(), merged, rows.shape[1] * rows.element_size(), dst
            )
            remaining = check_deadline(request_id, deadline_mono, "embedding")
        except BaseException:
            release()
            raise
        self._engine.write_within(
            dst.session_id,
            plan,
            self._max_descriptors,
            remaining,
            what=f"embedding transfer for {request_id}",
            thread_name=f"embedding-send-{request_id}",
            on_done=release,
        )
        return TransferResult(
            request_id, plan.num_bytes, plan.num_descriptors, time.monotonic() - start
        )

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
        own = torch.empty_like(
            rows, device=self._staging_device(rows), pin_memory=self._pinned(rows)
        )
        own.copy_(rows)  # not in staging: register a private copy for this one write
        self._engine.register([(own.data_ptr(), own.numel() * own.element_size())])
        return own, lambda: self._engine.unregister([own.data_ptr()])

    def _staging_for(self, rows: torch.Tensor) -> EmbeddingBuffer | None:
        device = self._staging_device(rows)
        if self._staging is None:
            self._staging = EmbeddingBuffer(
                self._staging_rows, rows.shape[1], rows.dtype, device, pin_memory=self._pinned(rows)
            )
            self._engine.register([self._staging.memory_region()])
        staging = self._staging
        same = (staging.hidden_size, staging.dtype, staging.tensor.device) == (
            rows.shape[1],
            rows.dtype,
            device,
        )
        return staging if same else None

    @staticmethod
    def _staging_device(rows: torch.Tensor) -> torch.device:
        """Where registered rows live: host memory unless this Mooncake build moves GPU memory."""
        return rows.device if mooncake_moves_device_memory() else torch.device("cpu")

    def _pinned(
        self, rows: torch.Tensor
    ) -> bool:  # GPU rows staged on the host: pinned for the copy
        return rows.is_cuda and self._staging_device(rows).type == "cpu"

    def close(self) -> None:
        with self._lock:
            self._engine.unregister_all()
            self._staging = None
