"""In-process embedding backend: encoder and prefill share one process; rows move by tensor copies.

Receivers publish their buffer on an ``EmbeddingFabric`` under their ``session_id``;
senders sharing that fabric look the buffer up and copy each coalesced run of rows
with one slice copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.common.errors import UnavailableError
from services.transfer.base import TransferResult
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    RowRun,
    rows_sent,
)
from services.transfer.inprocess_registry import InProcessRegistry


class EmbeddingFabric(InProcessRegistry[EmbeddingBuffer]):
    """``session_id`` -> registered embedding buffer, for the senders and receivers of a process."""

    def __init__(self) -> None:
        super().__init__(id_prefix="inprocess-embeddings", kind="embedding buffer")


_DEFAULT_FABRIC = EmbeddingFabric()  # used when a caller wires one process without passing a fabric


class InProcessEmbeddingSender(BaseEmbeddingSender):
    backend = "inprocess"

    def __init__(self, fabric: EmbeddingFabric | None = None) -> None:
        self._fabric = fabric or _DEFAULT_FABRIC

    def _write_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        merged: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
        start: float,
    ) -> TransferResult:
        buffer = self._fabric.get(dst.session_id)
        try:
            first_row = buffer.row_of_address(dst.base_address)
        except ValueError as exc:
            raise UnavailableError(
                f"{dst.session_id} no longer holds the window of {request_id}: {exc}"
            ) from exc
        for src, dst_row, num_rows in merged:
            buffer.rows(first_row + dst_row, num_rows).copy_(rows[src : src + num_rows])
        return rows_sent(request_id, rows, merged, start)


class InProcessEmbeddingReceiver(BaseEmbeddingReceiver):
    backend = "inprocess"

    def __init__(self, fabric: EmbeddingFabric | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fabric = fabric or _DEFAULT_FABRIC
        self._session_id = self._fabric.new_session_id()

    @property
    def session_id(self) -> str:
        return self._session_id

    def _register_memory(self, buffer: EmbeddingBuffer) -> None:
        self._fabric.register(self._session_id, buffer)

    def _unregister_memory(self, buffer: EmbeddingBuffer) -> None:
        del buffer
        self._fabric.unregister(self._session_id)
