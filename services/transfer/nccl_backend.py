"""NCCL backend: prefill -> decode KV between GPUs of one host, over torch.distributed send/recv.

The channel is a process group holding both ranks (NCCL between GPUs; the same code
runs over gloo on CPU, which the tests use). NCCL is two-sided, so decode takes part:
its receiver runs a listener thread, on its own CUDA stream. Per request the sender sends
one header (request id, page count, bytes), then the payload as layer chunks (about 32 MiB
each, at most 8) of one contiguous staging buffer, each chunk
``[2 (K, V), chunk layers, pages, page_size, kv_heads, head_dim]``: gathering chunk i+1
overlaps sending chunk i, and scattering chunk i overlaps receiving chunk i+1. Pages are
gathered / scattered with one indexed copy per chunk: never one call per page.

NCCL matches messages in order and has no tags, so a send always delivers its whole
payload, even after its deadline: the receiver drains it into staging and writes pages
only while the session is live. Releasing a session's pages waits for an in-flight
scatter, so a late write never lands in pages already handed to another request.

States and deadlines are base.py's ``TransferSession``: BOOTSTRAPPING at ``open_session``,
TRANSFERRING when the header arrives, SUCCESS once the pages hold the KV, FAILED on
deadline, abort, or a header that does not match the session (pages released once).
A sender whose previous send is still pending at its next deadline (peer gone or stuck)
raises ``UnavailableError``.

The receiver posts a header receive only while a session is open, so an idle decode
process holds no pending NCCL operation (NCCL's watchdog would end it, and a process
group cannot be destroyed under one); a send to a decode with no open session waits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from services.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    ReleaseFn,
    TransferResult,
    TransferSession,
    check_compatible,
    check_deadline,
    pool_layout,
)

HEADER_BYTES = 1024
CHUNK_BYTES = 32 * 1024 * 1024  # target chunk size: enough to pipeline, few enough calls
MAX_CHUNKS = 8


class _Header(msgspec.Struct, frozen=True):
    request_id: str
    num_pages: int
    num_bytes: int
    num_chunks: int


def encode_header(header: _Header, device: torch.device) -> torch.Tensor:  # [HEADER_BYTES] uint8
    data = msgspec.msgpack.encode(header)
    if len(data) + 4 > HEADER_BYTES:
        raise InvalidRequestError(
            f"request id too long for a KV transfer header: {header.request_id[:64]}..."
        )
    raw = len(data).to_bytes(4, "little") + data
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def decode_header(buf: torch.Tensor) -> _Header:
    raw = bytes(buf.cpu().numpy().tobytes())
    size = int.from_bytes(raw[:4], "little")
    return msgspec.msgpack.decode(raw[4 : 4 + size], type=_Header)


def layer_chunks(num_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` (or fewer) contiguous ``[start, end)`` layer ranges covering every layer."""
    num_chunks = max(1, min(num_chunks, num_layers))
    bounds = [round(i * num_layers / num_chunks) for i in range(num_chunks + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def chunk_views(
    flat: torch.Tensor, pool: KVPool, num_pages: int, chunks: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Views of ``flat`` (one staging buffer), chunk i ``[2, layers_i, pages, S, Hkv, D]``."""
    views, offset = [], 0
    for a, b in chunks:
        shape = (2, b - a, num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim)
        size = 2 * (b - a) * num_pages * pool.page_size * pool.num_kv_heads * pool.head_dim
        views.append(flat[offset : offset + size].view(shape))
        offset += size
    assert offset == flat.numel()
    return views


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def completion(works: list[Any], device: torch.device) -> Callable[[], bool]:
    """A non-blocking "all done?" for ``works``: NCCL ones are polled, gloo ones ``wait``ed."""
    if device.type == "cuda":
        return lambda: all(w.is_completed() for w in works)
    done = threading.Event()

    def wait() -> None:
        for work in works:
            work.wait()
        done.set()

    threading.Thread(target=wait, name="kv-transfer-wait", daemon=True).start()
    return done.is_set


def _stream_wait(work: Any, device: torch.device) -> None:
    """Order this stream after a completed NCCL work (``completion`` already waited gloo's)."""
    if device.type == "cuda":
        work.wait()


def wait_until(
    is_done: Callable[[], bool],
    deadline: float,
    stop: Callable[[], bool] = lambda: False,
    idle: Callable[[], bool] = lambda: False,
) -> bool:
    """Poll ``is_done`` until True, or deadline / ``stop()`` (False); sleeps 1 ms if ``idle()``."""
    while not is_done():
        if time.monotonic() >= deadline or stop():
            return False
        time.sleep(
            0.001 if idle() else 0
        )  # sleep(0) yields the GIL; a transfer is expected, keep latency low
    return True


class NcclKVSender(BaseKVSender):
    """Prefill side of one NCCL channel (the default group, or ``group``) to ``peer_rank``."""

    backend = "nccl"

    def __init__(self, peer_rank: int, group: Any = None, num_chunks: int | None = None) -> None:
        self.peer_rank = peer_rank
        self.group = group
        self.num_chunks = num_chunks  # None: one per CHUNK_BYTES, at most MAX_CHUNKS
        self._lock = threading.Lock()
        self._pending: Callable[[], bool] | None = (
            None  # completion of a send that missed its deadline
        )
        self._pending_keep: list[torch.Tensor] = []  # its buffers, alive until the works complete

    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline: float,
    ) -> TransferResult:
        start = time.monotonic()
        check_compatible(pool_layout(src_pool), src_pages, dst)
        if dst.session_id != f"nccl:{self.peer_rank}":
            raise UnavailableError(
                f"{dst.session_id} is not this sender's NCCL peer (rank {self.peer_rank})"
            )
        with self._lock:
            check_deadline(request_id, deadline)
            if self._pending is not None and not wait_until(self._pending, deadline):
                raise UnavailableError(
                    f"NCCL peer rank {self.peer_rank} has not taken an earlier KV transfer"
                )
            self._pending, self._pending_keep = None, []
            works, keep = self._post(request_id, src_pool, src_pages)
            is_done = completion(works, src_pool.device)
            if not wait_until(is_done, deadline):
                self._pending, self._pending_keep = is_done, keep
                raise DeadlineExceededError(
                    f"KV transfer for {request_id} to rank {self.peer_rank} timed out"
                )
        flat = keep[-1]
        return TransferResult(
            request_id, flat.numel() * flat.element_size(), len(works), time.monotonic() - start
        )

    def _post(
        self, request_id: str, pool: KVPool, src_pages: Sequence[int]
    ) -> tuple[list[Any], list[torch.Tensor]]:
        device = pool.device
        numel = (
            2
            * pool.num_layers
            * len(src_pages)
            * pool.page_size
            * pool.num_kv_heads
            * pool.head_dim
        )
        flat = torch.empty(numel, dtype=pool.dtype, device=device)
        num_chunks = self.num_chunks or max(
            1, min(MAX_CHUNKS, numel * flat.element_size() // CHUNK_BYTES)
        )
        chunks = layer_chunks(pool.num_layers, num_chunks)
        header = _Header(request_id, len(src_pages), numel * flat.element_size(), len(chunks))
        header_buf = encode_header(header, device)
        index = torch.tensor(list(src_pages), dtype=torch.long, device=device)
        works = [dist.isend(header_buf, self.peer_rank, group=self.group)]
        for (a, b), view in zip(
            chunks, chunk_views(flat, pool, len(src_pages), chunks), strict=True
        ):
            torch.index_select(
                pool.k_buffer[a:b], 1, index, out=view[0]
            )  # [layers, pages, S, Hkv, D]
            torch.index_select(pool.v_buffer[a:b], 1, index, out=view[1])
            works.append(
                dist.isend(view, self.peer_rank, group=self.group)
            )  # waits for the gather above
        return works, [header_buf, index, flat]


class NcclKVReceiver(BaseKVReceiver):
    """Decode side: a listener thread receives each transfer, scattering it into its pages."""

    backend = "nccl"

    def __init__(self, peer_rank: int, group: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peer_rank = peer_rank
        self.group = group
        self._rank = dist.get_rank()
        self._stop = threading.Event()
        self._wake = (
            threading.Event()
        )  # set when a session opens (or on close): the listener posts a receive
        self._scatter_lock = threading.Lock()  # held from scatter launch until it landed
        self._thread: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None
        self.error: BaseException | None = None  # what stopped the listener, if anything

    @property
    def session_id(self) -> str:
        return f"nccl:{self._rank}"

    def open_session(
        self, request_id: str, pages: Sequence[int], deadline: float, release: ReleaseFn
    ) -> TransferSession:
        def release_after_scatter(rid: str, page_ids: tuple[int, ...]) -> None:
            with self._scatter_lock:
                release(rid, page_ids)

        session = super().open_session(request_id, pages, deadline, release_after_scatter)
        self._wake.set()
        return session

    def _register_memory(self, pool: KVPool) -> None:
        if pool.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=pool.device)
        self._thread = threading.Thread(
            target=self._listen, args=(pool,), name="kv-nccl-recv", daemon=True
        )
        self._thread.start()

    def _unregister_memory(self, pool: KVPool) -> None:
        del pool
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _poll(self, works: list[Any], device: torch.device) -> bool:
        """Wait for ``works`` until the receiver closes (False); spin only while KV is expected."""
        return wait_until(
            completion(works, device),
            float("inf"),
            self._stop.is_set,
            idle=lambda: self.sessions.num_in_flight == 0,
        )

    def _listen(self, pool: KVPool) -> None:
        on_cuda = self._stream is not None
        with (
            torch.cuda.device(pool.device) if on_cuda else contextlib.nullcontext(),
            torch.cuda.stream(self._stream) if on_cuda else contextlib.nullcontext(),
        ):
            try:
                while not self._stop.is_set():
                    if (
                        self.sessions.num_in_flight == 0
                    ):  # no receive stays posted while nothing is expected
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    header_buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=pool.device)
                    work = dist.irecv(header_buf, self.peer_rank, group=self.group)
                    if not self._poll([work], pool.device):
                        return
                    _stream_wait(work, pool.device)
                    self._receive(pool, decode_header(header_buf))
            except BaseException as exc:  # the thread's last resort: fail every waiting session
                self.error = exc
                self.sessions.abort_all()
                raise

    def _live_session(self, header: _Header) -> TransferSession | None:
        session = self.sessions.get(header.request_id)
        if session is None:
            return None  # expired, aborted or unknown: the payload is drained and dropped
        if len(session.page_ids) != header.num_pages:
            session.mark_failed(
                InvalidRequestError(
                    f"KV for {header.request_id}: {header.num_pages} pages sent, "
                    f"{len(session.page_ids)} reserved"
                )
            )
            return None
        session.mark_transferring()
        return session

    def _receive(self, pool: KVPool, header: _Header) -> None:
        session = self._live_session(header)
        chunks = layer_chunks(pool.num_layers, header.num_chunks)
        flat = torch.empty(
            header.num_bytes // pool.k_buffer.element_size(), dtype=pool.dtype, device=pool.device
        )
        views = chunk_views(flat, pool, header.num_pages, chunks)
        works = [dist.irecv(view, self.peer_rank, group=self.group) for view in views]
        index = (
            None
            if session is None
            else torch.tensor(session.page_ids, dtype=torch.long, device=pool.device)
        )
        for (a, b), view, work in zip(chunks, views, works, strict=True):
            if not self._poll([work], pool.device):
                return
            _stream_wait(work, pool.device)
            if session is None or index is None:
                continue
            with self._scatter_lock:
                if session.state.is_terminal:
                    continue
                pool.k_buffer[a:b].index_copy_(1, index, view[0])
                pool.v_buffer[a:b].index_copy_(1, index, view[1])
                _synchronize(pool.device)
        _synchronize(pool.device)
        if session is not None and not session.state.is_terminal:
            # it may still fail (deadline, abort) while the last chunk lands: its pages are then
            # released
            with contextlib.suppress(StageServeError):
                session.mark_done()
