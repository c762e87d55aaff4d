"""CUDA IPC backend: prefill writes KV straight into decode's pages on another GPU of the host.

Decode exports its pool's K and V allocations once (CUDA IPC handles, inside its
``session_id``); prefill maps them into its own GPU's address space (peer access over
NVLink, enabled by the driver when the handle is opened) and moves a request with one
kernel: every ``(page, layer, K|V)`` block is read from prefill's pool and stored into
decode's page, so there is no staging copy, no per-page call and no receiver thread.

It is one-sided like Mooncake: ``send`` returns once the kernel finished (the bytes are
in decode's memory); decode learns it from the request protocol (``Generate``), as for
Mooncake. ``start`` only queues the kernel: a batch's requests go back to back on the
link, each one's host work overlapping the previous one's bytes. A send that misses its
deadline cannot be stopped: its kernel still runs to the
end (milliseconds), which decode's page quarantine already covers (see base.py).

Prefill streams a request layer by layer (``start_layerwise``): each chunk of layers is
copied on a side stream as soon as the forward queued those layers, so the link carries
the KV while later layers compute (and does not go idle, which makes a lone copy after
the forward slower); only the last chunk is left when the forward ends.

Both processes must see both GPUs (no disjoint ``CUDA_VISIBLE_DEVICES``) and the GPUs
must be peers; otherwise ``send`` fails with ``UnavailableError``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import torch

from services.common.errors import InvalidRequestError, UnavailableError
from services.engine import ops
from services.engine.kv_cache import KVPool
from services.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KvDestination,
    LayerwiseSend,
    PendingSend,
    TransferResult,
    check_compatible,
    check_deadline,
    pool_layout,
    whole_pages,
)
from services.transfer.cuda_ipc_memory import (
    IpcBuffer,
    IpcReceiver,
    decode_session,
    device_uuid,
    encode_session,
    export_buffer,
    open_buffer,
    peer_index,
)

SESSION_PREFIX = "cuda-ipc:"
MAX_PEERS = 16  # decode pools kept mapped per sender; the least recently used is unmapped beyond it
LAYER_CHUNK_BYTES = 8 << 20  # least bytes per copy when a request goes out layer by layer


class IpcPool(msgspec.Struct, frozen=True, array_like=True):
    """What decode publishes in its ``session_id``: where its pool lives and its shape."""

    device_uuid: str
    shape: tuple[int, ...]  # [L, P, S, H, D] of each of K and V
    dtype: str
    k: IpcBuffer
    v: IpcBuffer


def encode_session_id(pool: IpcPool) -> str:
    return encode_session(SESSION_PREFIX, pool)


def decode_session_id(session_id: str) -> IpcPool:
    return decode_session(SESSION_PREFIX, session_id, IpcPool, "CUDA IPC KV destination")


class CudaIpcKVReceiver(IpcReceiver, BaseKVReceiver):
    """Decode side: exports the pool at ``register``; completion comes from the request protocol."""

    def _register_memory(self, pool: KVPool) -> None:
        if pool.device.type != "cuda":
            raise ValueError(
                f"the cuda_ipc KV backend needs a CUDA KV pool, got one on {pool.device}"
            )
        torch.cuda.synchronize(
            pool.k_buffer.device
        )  # the exported memory is initialized before anyone maps it
        self._session_id = encode_session_id(
            IpcPool(
                device_uuid(pool.k_buffer.device),
                tuple(pool.k_buffer.shape),
                str(pool.dtype).removeprefix("torch."),
                export_buffer(pool.k_buffer),
                export_buffer(pool.v_buffer),
            )
        )


class CudaIpcKVSender(BaseKVSender):
    """Prefill side: maps each decode pool once, then one page-copy kernel per request."""

    backend = "cuda_ipc"
    streams_layers = True

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        assert max_peers > 0
        self.max_peers = max_peers
        self._lock = threading.Lock()
        # (session id, this GPU) -> decode's K and V mapped here; least recently used first
        self._peers: OrderedDict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )
        # queued copies with what they read and write through (decode's mapping, the page numbers):
        # kept until their event fired, whether or not anyone still waits for them
        self._in_flight: list[tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> TransferResult:
        return self.start(request_id, src_pool, src_pages, dst, deadline_mono).wait()

    def start(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> PendingSend:
        """Check, map decode's pool if new, and queue the copy kernel on the caller's stream."""
        start = time.monotonic()
        peer, pages = self._prepare(request_id, src_pool, src_pages, dst, deadline_mono)
        with torch.cuda.device(
            src_pool.k_buffer.device
        ):  # Triton launches on the current device's stream
            ops.copy_pages(
                src_pool.k_buffer, src_pool.v_buffer, pages[0], peer[0], peer[1], pages[1]
            )
            done = torch.cuda.Event()
            done.record()
        self._track(done, (*peer, pages))
        return _IpcSend(request_id, _num_bytes(src_pool, src_pages), done, start, deadline_mono)

    def start_layerwise(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> LayerwiseSend:
        """Check and map as ``start``; the copies are queued as the forward's layers finish."""
        start = time.monotonic()
        peer, pages = self._prepare(request_id, src_pool, src_pages, dst, deadline_mono)
        return _LayerwiseIpcSend(self, request_id, src_pool, peer, pages, start, deadline_mono)

    def _prepare(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Decode's K and V mapped here, and the page numbers ``[2, n]`` (source, destination),
        pinned.

        The kernel reads the page numbers straight from pinned host memory (no upload on the
        stream); they and the mapping must outlive the copy (``_track``).
        """
        if dst.backend != self.backend:
            raise InvalidRequestError(
                f"{request_id}: a {dst.backend} destination given to the cuda_ipc sender"
            )
        heads = check_compatible(pool_layout(src_pool), src_pages, dst)
        whole_pages(heads, self.backend, request_id)
        if src_pool.device.type != "cuda":
            raise InvalidRequestError(
                f"the cuda_ipc KV backend needs a CUDA KV pool, got one on {src_pool.device}"
            )
        check_deadline(request_id, deadline_mono)
        peer = self._peer(dst, src_pool)
        pages = torch.empty((2, len(src_pages)), dtype=torch.int32, pin_memory=True)
        numbers = pages.numpy()
        numbers[0], numbers[1] = src_pages, dst.page_ids
        return peer, pages

    def _track(self, done: torch.cuda.Event, keep: tuple[torch.Tensor, ...]) -> None:
        with self._lock:
            self._in_flight.append((done, keep))

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream layer-by-layer copies run on (one per GPU), beside the forward's."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    def _peer(self, dst: KvDestination, src_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode's K and V mapped into this GPU (once per pool), checked against ``dst.layout``."""
        key = (dst.session_id, src_pool.k_buffer.device)
        with self._lock:
            self._in_flight = [(done, keep) for done, keep in self._in_flight if not done.query()]
            peer = self._peers.get(key)
            if peer is None:
                peer = self._peers[key] = self._open(decode_session_id(dst.session_id), src_pool)
                while (
                    len(self._peers) > self.max_peers
                ):  # a restarted decode exports a new pool: the
                    self._peers.popitem(
                        last=False
                    )  # old mapping goes (closed once nothing uses it)
            self._peers.move_to_end(key)
        layout = dst.layout
        expected = (
            layout.num_layers,
            layout.num_pages,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        if tuple(peer[0].shape) != expected or peer[0].dtype != src_pool.dtype:
            raise InvalidRequestError(
                f"{dst.request_id}: destination layout {expected} {layout.dtype} does not match "
                "the "
                f"exported pool {tuple(peer[0].shape)} {peer[0].dtype}"
            )
        return peer

    def _open(self, exported: IpcPool, src_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        if exported.dtype != str(src_pool.dtype).removeprefix("torch."):
            raise InvalidRequestError(
                f"decode's KV pool is {exported.dtype}, this one {src_pool.dtype}"
            )
        device = src_pool.k_buffer.device  # with its index, unlike a pool made on "cuda"
        index = peer_index(exported.device_uuid, device, "decode")
        try:
            return (
                open_buffer(exported.k, exported.shape, src_pool.dtype, device),
                open_buffer(exported.v, exported.shape, src_pool.dtype, device),
            )
        except RuntimeError as exc:
            raise UnavailableError(f"cannot map decode's KV pool on GPU {index}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            # a queued copy's mapping stays in _in_flight until its kernel is done
            self._peers.clear()


class _IpcSend(PendingSend):
    """One queued copy kernel: ``done`` fires when decode's pages hold the bytes."""

    def __init__(
        self,
        request_id: str,
        num_bytes: int,
        done: torch.cuda.Event,
        started: float,
        deadline_mono: float,
    ) -> None:
        self.request_id, self.num_bytes, self.done = request_id, num_bytes, done
        self.started, self.deadline_mono = started, deadline_mono

    def wait(self) -> TransferResult:
        while not self.done.query():
            # past the deadline the kernel still finishes; decode quarantines the pages
            check_deadline(self.request_id, self.deadline_mono)
            # releases the GIL; sleep(0) would add the kernel's timer slack
            os.sched_yield()
        elapsed = time.monotonic() - self.started
        return TransferResult(self.request_id, self.num_bytes, 1 if self.num_bytes else 0, elapsed)


class _LayerwiseIpcSend(LayerwiseSend):
    """Copies layers ``[queued, i]`` on the sender's side stream once the forward queued layer i.

    Each chunk waits (an event on the forward's stream) for its layers' KV, then reads those
    layers of every page of the request. Chunks hold at least ``LAYER_CHUNK_BYTES`` (each launch
    costs host time), so a small request goes in one copy after its last layer.
    """

    def __init__(
        self,
        sender: CudaIpcKVSender,
        request_id: str,
        src_pool: KVPool,
        peer: tuple[torch.Tensor, torch.Tensor],
        pages: torch.Tensor,
        started: float,
        deadline_mono: float,
    ) -> None:
        self.sender, self.request_id, self.src_pool, self.peer, self.pages = (
            sender,
            request_id,
            src_pool,
            peer,
            pages,
        )
        self.started, self.deadline_mono = started, deadline_mono
        self.device = src_pool.k_buffer.device
        self.stream = sender._side_stream(self.device)
        self.num_layers = src_pool.num_layers
        layer_bytes = 2 * pages.shape[1] * src_pool.page_nbytes
        self.chunk_layers = max(1, -(-LAYER_CHUNK_BYTES // max(layer_bytes, 1)))
        self.queued = 0  # layers [0, queued) have their copy queued
        self.ended = False

    def layer_done(self, layer: int) -> None:
        assert not self.ended and self.queued <= layer < self.num_layers, (layer, self.queued)
        if layer + 1 - self.queued >= self.chunk_layers:
            self._queue(layer + 1)

    def _queue(self, end: int) -> None:
        first, self.queued = self.queued, end
        with torch.cuda.device(self.device):
            ready = torch.cuda.Event()
            ready.record()  # the forward's (current) stream, behind layer end - 1
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                ops.copy_pages(
                    self.src_pool.k_buffer[first:end],
                    self.src_pool.v_buffer[first:end],
                    self.pages[0],
                    self.peer[0][first:end],
                    self.peer[1][first:end],
                    self.pages[1],
                )

    def _end(self) -> torch.cuda.Event:
        self.ended = True
        with torch.cuda.device(self.device):
            done = torch.cuda.Event()
            done.record(self.stream)
            torch.cuda.current_stream().wait_event(
                done
            )  # pages freed after this are reused only behind the copies
        self.sender._track(done, (*self.peer, self.pages))
        return done

    def finish(self) -> PendingSend:
        assert not self.ended
        try:
            if self.queued < self.num_layers:
                self._queue(self.num_layers)
        finally:
            done = self._end()
        return _IpcSend(
            self.request_id,
            _num_bytes(self.src_pool, self.pages[0]),
            done,
            self.started,
            self.deadline_mono,
        )

    def cancel(self) -> None:
        if not self.ended:
            self._end()


def _num_bytes(pool: KVPool, pages: Sequence[int] | torch.Tensor) -> int:
    return 2 * pool.num_layers * len(pages) * pool.page_nbytes
