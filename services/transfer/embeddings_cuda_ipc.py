"""CUDA IPC embedding backend: an encoder rank writes rows straight into prefill's GPU buffer.

Prefill's receiver exports its buffer's allocation once at ``register`` and publishes it
(handle, shape, dtype, the buffer's base address and the owner process) as its
``session_id``; a destination's ``base_address`` then says which window of the buffer the
request owns. An encoder rank maps each buffer once into its own GPU (``cuda_ipc_memory``,
LRU of ``max_peers``), copies every coalesced run of rows with one device copy on its
current stream (behind the ViT that made them), and waits for the copies before it reports
the rows written: the completion protocol is the other backends' (Encode returns once the
rows landed). Rows never pass through host memory.

A buffer lives as long as its owner, the prefill rank process: a sender refuses
(``UnavailableError``), before it maps or writes, a buffer whose owner has exited (when both
share a pid namespace; otherwise it cannot tell). Prefill only reads the buffer, and frees a
request's rows once the step that read them returned its result.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import torch

from services.common.errors import InvalidRequestError, UnavailableError
from services.transfer.base import TransferResult, check_deadline
from services.transfer.cuda_ipc_memory import (
    IpcBuffer,
    IpcReceiver,
    OwnerProcess,
    decode_session,
    device_uuid,
    encode_session,
    export_buffer,
    open_buffer,
    peer_index,
)
from services.transfer.embeddings import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    EmbeddingBuffer,
    EmbeddingDestination,
    RowRun,
    dtype_name,
    rows_sent,
)

SESSION_PREFIX = "cuda-ipc-rows:"
WHAT = "CUDA IPC embedding destination"
MAX_PEERS = (
    16  # prefill buffers kept mapped per sender; the least recently used is unmapped beyond it
)
ROW_DTYPES = ("float32", "bfloat16", "float16")


class IpcRows(msgspec.Struct, frozen=True, array_like=True):
    """What prefill publishes in its ``session_id``: where its embedding buffer is, its shape."""

    device_uuid: str
    num_rows: int
    hidden_size: int
    dtype: str  # torch dtype name without prefix
    base_address: int  # the buffer's first row in prefill's process; windows are relative to it
    owner: OwnerProcess
    buffer: IpcBuffer  # [num_rows, hidden_size], contiguous

    @property
    def row_nbytes(self) -> int:
        return self.hidden_size * getattr(torch, self.dtype).itemsize


def encode_session_id(exported: IpcRows) -> str:
    return encode_session(SESSION_PREFIX, exported)


def decode_session_id(session_id: str) -> IpcRows:
    """The buffer ``session_id`` names; ``InvalidRequestError`` unless ``encode_session_id``'s."""
    exported = decode_session(SESSION_PREFIX, session_id, IpcRows, WHAT)
    problem = _problem(exported)
    if problem:
        raise InvalidRequestError(f"malformed {WHAT}: {problem}", param="embedding_refs")
    return exported


def _problem(exported: IpcRows) -> str | None:
    if exported.num_rows <= 0 or exported.hidden_size <= 0:
        return f"shape [{exported.num_rows}, {exported.hidden_size}]"
    if exported.dtype not in ROW_DTYPES:
        return f"dtype {exported.dtype!r} (not one of {', '.join(ROW_DTYPES)})"
    if exported.base_address < 0 or exported.buffer.storage_offset_bytes < 0:
        return "a negative address"
    if exported.buffer.storage_size_bytes < exported.num_rows * exported.row_nbytes:
        return f"{exported.buffer.storage_size_bytes} bytes exported for {exported.num_rows} rows"
    return None


class CudaIpcEmbeddingReceiver(IpcReceiver, BaseEmbeddingReceiver):
    """Prefill side: exports the GPU buffer at ``register``; completion comes from Encode."""

    def _register_memory(self, buffer: EmbeddingBuffer) -> None:
        tensor = buffer.tensor  # [num_rows, hidden]
        if tensor.device.type != "cuda":
            raise ValueError(
                "the cuda_ipc embedding backend needs a CUDA buffer (prefill on a GPU), "
                f"got one on {tensor.device}"
            )
        torch.cuda.synchronize(
            tensor.device
        )  # the exported rows are zeroed before anyone maps them
        self._session_id = encode_session_id(
            IpcRows(
                device_uuid(tensor.device),
                buffer.num_rows,
                buffer.hidden_size,
                dtype_name(buffer.dtype),
                buffer.base_address,
                OwnerProcess.this_process(),
                export_buffer(tensor),
            )
        )


class CudaIpcEmbeddingSender(BaseEmbeddingSender):
    """Encoder side: maps each prefill buffer once per GPU, then one device copy per run."""

    backend = "cuda_ipc"

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        assert max_peers > 0
        self.max_peers = max_peers
        self._lock = threading.Lock()
        # (session id, this GPU) -> (its owner, the buffer mapped here); least recently used first
        self._peers: OrderedDict[tuple[str, torch.device], tuple[OwnerProcess, torch.Tensor]] = (
            OrderedDict()
        )

    def _check_send(
        self, request_id: str, rows: torch.Tensor, runs: Sequence[RowRun], dst: EmbeddingDestination
    ) -> None:
        super()._check_send(request_id, rows, runs, dst)
        decode_session_id(dst.session_id)  # a malformed one is refused before any CUDA call
        if rows.device.type != "cuda":
            raise InvalidRequestError(
                f"{request_id}: the cuda_ipc embedding backend sends rows from a GPU, "
                f"got rows on {rows.device}"
            )

    def _write_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        merged: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
        start: float,
    ) -> TransferResult:
        exported = decode_session_id(dst.session_id)
        if exported.owner.has_exited():
            raise UnavailableError(
                f"prefill's embedding buffer is gone: its owner (pid {exported.owner.pid}) exited"
            )
        window = self._window(request_id, dst, exported, rows.device)
        with torch.cuda.device(rows.device):
            for src, dst_row, num_rows in merged:
                window[dst_row : dst_row + num_rows].copy_(rows[src : src + num_rows])
            done = torch.cuda.Event()
            done.record()
        _wait(done, request_id, deadline_mono)
        return rows_sent(request_id, rows, merged, start)

    def _window(
        self, request_id: str, dst: EmbeddingDestination, exported: IpcRows, device: torch.device
    ) -> torch.Tensor:
        """The destination's rows mapped on ``device``: ``[dst.num_rows, hidden]``."""
        if (dst.hidden_size, dst.dtype, dst.row_stride_bytes) != (
            exported.hidden_size,
            exported.dtype,
            exported.row_nbytes,
        ):
            raise InvalidRequestError(
                f"{request_id}: destination rows [*, {dst.hidden_size}] {dst.dtype} (stride "
                f"{dst.row_stride_bytes} B) do not match the exported buffer "
                f"[*, {exported.hidden_size}] "
                f"{exported.dtype}",
                param="embedding_refs",
            )
        offset = dst.base_address - exported.base_address
        first_row = offset // exported.row_nbytes
        if (
            offset < 0
            or offset % exported.row_nbytes
            or first_row + dst.num_rows > exported.num_rows
        ):
            raise InvalidRequestError(
                f"{request_id}: the {dst.num_rows}-row window at {dst.base_address:#x} "
                "is not inside the "
                f"exported {exported.num_rows}-row buffer",
                param="embedding_refs",
            )
        buffer = self._peer(dst.session_id, exported, device)
        return buffer[first_row : first_row + dst.num_rows]

    def _peer(self, session_id: str, exported: IpcRows, device: torch.device) -> torch.Tensor:
        """Prefill's buffer mapped on ``device`` (opened once per buffer and GPU)."""
        key = (session_id, device)
        with self._lock:
            peer = self._peers.get(key)
            if (
                peer is None
            ):  # a new buffer, maybe a restarted prefill's: let go of exited owners' buffers
                for gone in [k for k, (owner, _) in self._peers.items() if owner.has_exited()]:
                    del self._peers[gone]
                peer = self._peers[key] = (exported.owner, _open(exported, device))
                while len(self._peers) > self.max_peers:
                    self._peers.popitem(last=False)  # unmapped once no copy uses it
            self._peers.move_to_end(key)
            return peer[1]

    def close(self) -> None:
        with self._lock:
            self._peers.clear()


def _open(exported: IpcRows, device: torch.device) -> torch.Tensor:
    index = peer_index(exported.device_uuid, device, "prefill")
    shape = (exported.num_rows, exported.hidden_size)
    try:
        return open_buffer(exported.buffer, shape, getattr(torch, exported.dtype), device)
    except RuntimeError as exc:
        raise UnavailableError(
            f"cannot map prefill's embedding buffer on GPU {index}: {exc}"
        ) from exc


def _wait(done: torch.cuda.Event, request_id: str, deadline_mono: float) -> None:
    """Until the copies before ``done`` finished; past ``deadline`` they still land."""
    while not done.query():
        check_deadline(request_id, deadline_mono, "embedding")
        os.sched_yield()  # releases the GIL without a sleep's timer slack
