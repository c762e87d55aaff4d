"""Shared-memory embedding backend: the encoder writes rows straight into prefill's buffer in /dev/shm.

Prefill's receiver moves its buffer into one segment at ``register`` (see ``shm_memory``)
and publishes ``shm:<name>@<buffer base>`` as its ``session_id``; a destination's
``base_address`` then says which window of the segment the request owns. The encoder
maps each segment once and copies every coalesced run of rows with one slice copy: GPU
rows go straight from the GPU into the mapping. The buffer is host memory on every host
(``buffer_device``) and, once moved into the segment, pageable: on a GPU host the driver
stages prefill's copy of a request's rows to the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from services.common.errors import DeadlineExceededError, InvalidRequestError
from services.transfer.base import TransferResult
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    RowRun,
    check_deadline,
    check_rows,
    coalesce_runs,
)
from services.transfer.shm_memory import (
    MAX_PEERS,
    ShmPeers,
    ShmRef,
    ShmSegment,
    decode_session_id,
    encode_session_id,
    typed_view,
)

BUFFER = "prefill's embedding buffer"


class ShmEmbeddingReceiver(BaseEmbeddingReceiver):
    """Prefill side: the buffer's rows move into a segment at ``register``; ``close`` unlinks it."""

    backend = "shm"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._segment: ShmSegment | None = None
        self._session_id: str | None = None

    @property
    def session_id(self) -> str:
        assert self._session_id is not None, "register(buffer) first"
        return self._session_id

    def buffer_device(self, compute_device: torch.device) -> torch.device:
        del compute_device  # host memory, whatever device the model runs on
        return torch.device("cpu")

    def _register_memory(self, buffer: EmbeddingBuffer) -> None:
        if buffer.tensor.device.type != "cpu":
            raise ValueError(
                f"the shm embedding backend needs a host buffer, got one on {buffer.tensor.device}"
            )
        segment = ShmSegment("emb", buffer.num_bytes, BUFFER)
        try:
            buffer.reallocate(
                lambda shape, dtype: typed_view(segment.tensor, 0, shape, dtype, BUFFER)
            )
        except BaseException:
            segment.close()
            raise
        self._segment = segment
        self._session_id = encode_session_id(ShmRef(segment.name, buffer.base_address))

    def _unregister_memory(self, buffer: EmbeddingBuffer) -> None:
        del buffer  # it keeps its mapping: prefill may still read it while shutting down
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._session_id = None


class ShmEmbeddingSender(BaseEmbeddingSender):
    """Encoder side: maps each prefill buffer once (LRU of ``max_peers``), then one copy per run."""

    backend = "shm"

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._peers = ShmPeers(max_peers)

    def send_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        runs: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline: float,
    ) -> TransferResult:
        start = time.monotonic()
        if dst.backend != self.backend:
            raise InvalidRequestError(
                f"{request_id}: a {dst.backend} destination for the shm sender"
            )
        check_rows(request_id, rows, runs, dst)
        merged = coalesce_runs(runs)
        check_deadline(request_id, deadline)
        if not merged:
            return TransferResult(request_id, 0, 0, time.monotonic() - start)
        window = self._window(request_id, dst)
        for src, dst_row, num_rows in merged:
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"embedding transfer for {request_id} passed its deadline"
                )
            window[dst_row : dst_row + num_rows].copy_(rows[src : src + num_rows])
        num_bytes = sum(n for _, _, n in merged) * rows.shape[1] * rows.element_size()
        return TransferResult(request_id, num_bytes, len(merged), time.monotonic() - start)

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

    def close(self) -> None:
        self._peers.close()
