"""Image-embedding handoff (vision encoder -> prefill): contracts, row bookkeeping, descriptors.

Lifecycle of one request's embedding rows (prefill owns the buffer):

  prefill: buffer = EmbeddingBuffer(num_rows, hidden, dtype); receiver.register(buffer)   (once)
           start = rows.allocate(n)             (EmbeddingRowManager; CapacityError when full)
           dst = receiver.destination(request_id, start, n)
             -> EmbeddingDestination (msgspec; EmbeddingRef)
           ... Encode(spans with dest_row relative to ``start``, embedding_refs=[dst]) ...
           reads buffer.rows(start, n), then rows.free(start, n) in ``finally``
  encoder: sender.send_runs(request_id, rows, [(src_row, dst_row, n), ...], dst, deadline)
           one batched write of every span's rows (adjacent runs coalesced)

A destination is a *window* of the buffer: ``base_address`` is the address of its first
row and ``num_rows`` its size, so a sender can only write the rows allocated to the
request. A write abandoned at its deadline may still land until the engine's own
transfer timeout passes (Mooncake: ``MC_TRANSFER_TIMEOUT``); prefill should not reuse
the rows of a request whose Encode timed out before that.
"""

from __future__ import annotations

import bisect
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from services.common.destinations import EmbeddingDestination
from services.common.errors import CapacityError, InvalidRequestError
from services.transfer.base import TransferResult, check_backend, check_deadline

RowRun = tuple[int, int, int]  # (src_row, dst_row, num_rows)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class EmbeddingBuffer:
    """One contiguous ``[num_rows, hidden_size]`` tensor a prefill rank registers once."""

    def __init__(
        self,
        num_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,  # host rows a GPU reads (needs CUDA)
    ) -> None:
        assert num_rows > 0 and hidden_size > 0
        self.tensor = torch.zeros(
            num_rows, hidden_size, dtype=dtype, device=device, pin_memory=pin_memory
        )

    def reallocate(self, allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        """Move the rows into a zeroed contiguous ``allocator(shape, dtype)``, contents kept.

        For a transfer backend that owns the buffer's memory (``shm``), at registration.
        """
        new = allocator(tuple(self.tensor.shape), self.dtype)
        assert new.shape == self.tensor.shape and new.dtype == self.dtype and new.is_contiguous()
        new.copy_(self.tensor)
        self.tensor = new

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.tensor.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def row_stride_bytes(self) -> int:
        return self.tensor.stride(0) * self.tensor.element_size()

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.row_stride_bytes

    def memory_region(self) -> tuple[int, int]:
        return self.base_address, self.num_bytes

    def rows(self, start: int, num_rows: int) -> torch.Tensor:
        """A view of rows ``[start, start + num_rows)``; ``[num_rows, hidden]``."""
        assert 0 <= start and start + num_rows <= self.num_rows
        return self.tensor[start : start + num_rows]

    def row_of_address(self, address: int) -> int:
        """The row starting at ``address``; ``ValueError`` outside the buffer or off a row."""
        offset = address - self.base_address
        if (
            offset < 0
            or offset % self.row_stride_bytes
            or offset // self.row_stride_bytes >= self.num_rows
        ):
            raise ValueError(f"address {address:#x} is not a row start of this buffer")
        return offset // self.row_stride_bytes


class EmbeddingRowManager:
    """Single owner of a buffer's rows: contiguous ranges, first fit, freed ranges merged.

    Thread-safe. ``allocate`` raises ``CapacityError`` when no free range is long enough;
    ``free`` of anything but a live allocation raises ``ValueError`` (a bookkeeping bug).
    """

    def __init__(self, num_rows: int) -> None:
        assert num_rows > 0
        self.num_rows = num_rows
        self._free: list[tuple[int, int]] = [
            (0, num_rows)
        ]  # sorted (start, num_rows), never adjacent
        self._allocated: dict[int, int] = {}  # start -> num_rows
        self._lock = threading.Lock()

    @property
    def num_free_rows(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    @property
    def num_allocations(self) -> int:
        with self._lock:
            return len(self._allocated)

    def can_allocate(self, num_rows: int) -> bool:
        """True when one contiguous free range holds ``num_rows`` rows now."""
        with self._lock:
            return any(n >= num_rows for _, n in self._free)

    def allocate(self, num_rows: int) -> int:
        """Reserve ``num_rows`` (> 0) contiguous rows; returns the first row."""
        if num_rows <= 0:
            raise ValueError(f"allocate needs a positive row count, got {num_rows}")
        with self._lock:
            for i, (start, free_rows) in enumerate(self._free):
                if free_rows >= num_rows:
                    if free_rows == num_rows:
                        del self._free[i]
                    else:
                        self._free[i] = (start + num_rows, free_rows - num_rows)
                    self._allocated[start] = num_rows
                    return start
            largest = max((n for _, n in self._free), default=0)
        raise CapacityError(
            f"{num_rows} embedding rows needed; the largest free range has {largest} of "
            f"{self.num_rows}"
        )

    def free(self, start: int, num_rows: int) -> None:
        """Return the range ``allocate`` gave out as ``start`` (``num_rows`` must match)."""
        with self._lock:
            if self._allocated.get(start) != num_rows:
                raise ValueError(f"rows [{start}, {start + num_rows}) are not an allocation")
            del self._allocated[start]
            i = bisect.bisect_left(self._free, (start, 0))
            self._free.insert(i, (start, num_rows))
            if i + 1 < len(self._free) and start + num_rows == self._free[i + 1][0]:
                self._free[i] = (start, num_rows + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
                prev_start, prev_rows = self._free[i - 1]
                self._free[i - 1] = (prev_start, prev_rows + self._free.pop(i)[1])


def coalesce_runs(runs: Sequence[RowRun]) -> list[RowRun]:
    """Merge consecutive runs where both source and destination continue; empty runs dropped."""
    merged: list[RowRun] = []
    for src, dst, num_rows in runs:
        if num_rows == 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == src and merged[-1][1] + merged[-1][2] == dst:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + num_rows)
        else:
            merged.append((src, dst, num_rows))
    return merged


def check_rows(
    request_id: str, rows: torch.Tensor, runs: Sequence[RowRun], dst: EmbeddingDestination
) -> None:
    """``InvalidRequestError`` unless every run of ``rows`` fits ``dst`` with its row layout."""
    if rows.dim() != 2 or not rows.is_contiguous():
        raise InvalidRequestError(
            f"{request_id}: embedding rows must be a contiguous [n, hidden] tensor"
        )
    if rows.shape[1] != dst.hidden_size or dtype_name(rows.dtype) != dst.dtype:
        raise InvalidRequestError(
            f"{request_id}: rows are [*, {rows.shape[1]}] {dtype_name(rows.dtype)}, "
            "the destination holds "
            f"[*, {dst.hidden_size}] {dst.dtype}",
            param="embedding_refs",
        )
    if dst.row_stride_bytes < dst.row_nbytes:
        raise InvalidRequestError(f"{request_id}: destination row stride is smaller than a row")
    for src, dst_row, num_rows in runs:
        if src < 0 or num_rows < 0 or src + num_rows > rows.shape[0]:
            raise InvalidRequestError(
                f"{request_id}: source rows [{src}, {src + num_rows}) outside {rows.shape[0]}"
            )
        if dst_row < 0 or dst_row + num_rows > dst.num_rows:
            raise InvalidRequestError(
                f"{request_id}: destination rows [{dst_row}, {dst_row + num_rows}) outside the "
                f"{dst.num_rows} rows allocated",
                param="dest_row",
            )


class BaseEmbeddingReceiver(ABC):
    """Prefill side: registers one ``EmbeddingBuffer`` and describes windows of it."""

    backend: str
    _registers = "buffer"

    def __init__(self, cp_rank: int = 0) -> None:
        self.cp_rank = cp_rank
        self._buffer: EmbeddingBuffer | None = None

    @property
    @abstractmethod
    def session_id(self) -> str:
        """Session senders use to reach this receiver's engine."""

    @property
    def engine_address(self) -> str:
        return self.session_id

    @property
    def buffer(self) -> EmbeddingBuffer:
        assert self._buffer is not None, "register(buffer) first"
        return self._buffer

    @abstractmethod
    def _register_memory(self, buffer: EmbeddingBuffer) -> None: ...

    @abstractmethod
    def _unregister_memory(self, buffer: EmbeddingBuffer) -> None: ...

    def buffer_device(self, compute_device: torch.device) -> torch.device:
        """Where this backend can receive rows for a model on ``compute_device``. Default: there."""
        return compute_device

    def register(self, buffer: EmbeddingBuffer) -> None:
        """Register ``buffer`` with the engine; once per receiver, before any ``destination``."""
        assert self._buffer is None, "a receiver registers exactly one embedding buffer"
        self._register_memory(buffer)
        self._buffer = buffer

    def destination(self, request_id: str, start_row: int, num_rows: int) -> EmbeddingDestination:
        """The wire description of rows ``[start_row, start_row + num_rows)`` (a window)."""
        buffer = self.buffer
        if start_row < 0 or num_rows < 0 or start_row + num_rows > buffer.num_rows:
            raise InvalidRequestError(
                f"{request_id}: rows [{start_row}, {start_row + num_rows}) outside the "
                f"{buffer.num_rows}-row buffer"
            )
        return EmbeddingDestination(
            backend=self.backend,
            engine_address=self.engine_address,
            session_id=self.session_id,
            cp_rank=self.cp_rank,
            base_address=buffer.base_address + start_row * buffer.row_stride_bytes,
            num_rows=num_rows,
            row_stride_bytes=buffer.row_stride_bytes,
            hidden_size=buffer.hidden_size,
            dtype=dtype_name(buffer.dtype),
        )

    def close(self) -> None:
        if self._buffer is not None:
            self._unregister_memory(self._buffer)
            self._buffer = None


class BaseEmbeddingSender(ABC):
    """Encoder side: writes embedding rows into a registered prefill buffer, batched."""

    backend: str

    def _check_send(
        self, request_id: str, rows: torch.Tensor, runs: Sequence[RowRun], dst: EmbeddingDestination
    ) -> None:
        """``InvalidRequestError`` unless ``dst`` is this backend's and every run fits it."""
        check_backend(request_id, self.backend, dst)
        check_rows(request_id, rows, runs, dst)

    def send_rows(
        self,
        request_id: str,
        rows: torch.Tensor,
        dst: EmbeddingDestination,
        dst_row: int,
        deadline_mono: float,
    ) -> TransferResult:
        """Write all of ``rows`` ([n, hidden], contiguous) to ``dst`` rows ``[dst_row, +n)``."""
        return self.send_runs(request_id, rows, [(0, dst_row, rows.shape[0])], dst, deadline_mono)

    def send_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        runs: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
    ) -> TransferResult:
        """Write ``rows[src:src+n]`` to destination rows ``[dst_row, dst_row+n)`` per run, batched.

        ``deadline`` is ``time.monotonic()`` seconds. Returns after the bytes landed. Raises
        ``InvalidRequestError`` (layouts disagree, a run out of range), ``UnavailableError``
        (peer unreachable or the write failed) or ``DeadlineExceededError``. The checks, the
        merge of adjacent runs and the deadline are here; the backend's ``_write_runs`` copies.
        """
        start = time.monotonic()
        self._check_send(request_id, rows, runs, dst)
        merged = coalesce_runs(runs)
        if not merged:
            return rows_sent(request_id, rows, merged, start)
        check_deadline(request_id, deadline_mono, "embedding")
        return self._write_runs(request_id, rows, merged, dst, deadline_mono, start)

    @abstractmethod
    def _write_runs(
        self,
        request_id: str,
        rows: torch.Tensor,
        merged: Sequence[RowRun],
        dst: EmbeddingDestination,
        deadline_mono: float,
        start: float,
    ) -> TransferResult:
        """Copy each of the (checked, non-empty, merged) runs; the result counts from ``start``."""

    def close(self) -> None:
        """Release engine resources. Default: nothing held."""
        return None


def rows_sent(
    request_id: str, rows: torch.Tensor, merged: Sequence[RowRun], start: float
) -> TransferResult:
    """The result of writing the ``merged`` runs of ``rows``, one copy each, begun at ``start``."""
    num_bytes = sum(n for _, _, n in merged) * rows.shape[1] * rows.element_size()
    return TransferResult(request_id, num_bytes, len(merged), time.monotonic() - start)
