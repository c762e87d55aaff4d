"""Shared-memory embedding backend: the encoder writes rows into prefill's buffer in /dev/shm.

Prefill's receiver moves its buffer into one segment at ``register`` (see ``shm_memory``)
and publishes ``shm:<name>@<buffer base>`` as its ``session_id``; a destination's
``base_address`` then says which window of the segment the request owns. The encoder
maps each segment once and copies every coalesced run of rows with one slice copy: GPU
rows go straight from the GPU into the mapping. The buffer is host memory on every host
(``buffer_device``) and, once moved into the segment, pageable: on a GPU host the driver
stages prefill's copy of a request's rows to the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.errors import InvalidRequestError
from services.transfer.base import TransferResult, check_deadline
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    RowRun,
    rows_sent,
)
from services.transfer.shm_memory import (
    ShmReceiver,
    ShmSegment,
    ShmSender,
    decode_session_id,
    typed_view,
)

BUFFER = "prefill's embedding buffer"


class ShmEmbeddingReceiver(ShmReceiver, BaseEmbeddingReceiver):
    """Prefill side: the buffer's rows move into a segment at ``register``; ``close`` unlinks it."""

    def buffer_device(self, compute_device: torch.device) -> torch.device:
        del compute_device  # host memory, whatever device the model runs on
        return torch.device("cpu")

    def _register_memory(self, buffer: EmbeddingBuffer) -> None:
        if buffer.tensor.device.type != "cpu":
            raise ValueError(
                f"the shm embedding backend needs a host buffer, got one on {buffer.tensor.device}"
            )

        def move(segment: ShmSegment) -> int:
            buffer.reallocate(
                lambda shape, dtype: typed_view(segment.tensor, 0, shape, dtype, BUFFER)
            )
            return buffer.base_address

        self._own_segment("emb", buffer.num_bytes, BUFFER, move)


class ShmEmbeddingSender(ShmSender, BaseEmbeddingSender):
    """Encoder side: maps each prefill buffer once (LRU of ``max_peers``), then one copy per run."""

    def _write_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        merged: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
        start: float,
    ) -> TransferResult:
        window = self._window(request_id, dst)
        for src, dst_row, num_rows in merged:
            check_deadline(request_id, deadline_mono, "embedding")
            window[dst_row : dst_row + num_rows].copy_(rows[src : src + num_rows])
        return rows_sent(request_id, rows, merged, start)

    def _window(self, request_id: str, dst: EmbeddingDestination) -> torch.Tensor:
        """The destination's rows mapped here: ``[num_rows, hidden]``, the buffer's row stride."""
        ref = decode_session_id(dst.session_id)
        dtype = getattr(torch, dst.dtype)  # check_rows made it the rows' dtype
        if dst.row_stride_bytes % dtype.itemsize:
            raise InvalidRequestError(
                f"{request_id}: row stride {dst.row_stride_bytes} is not whole elements"
            )
        mapping = self._peers.open(ref.name, BUFFER)
        padded = typed_view(
            mapping.tensor,
            dst.base_address - ref.base_address,
            (dst.num_rows, dst.row_stride_bytes // dtype.itemsize),
            dtype,
            request_id,
        )
        return padded[:, : dst.hidden_size]
