"""KV pages in a Mooncake store shared by every prefill worker (the L3 tier's building block).

``KvStore`` is one ``mooncake.store.MooncakeDistributedStore`` client: it contributes
``segment_bytes`` of its process's memory to the store (0: none) and puts, finds and gets
pages by their prefix-cache page key (``services.common.prefix_keys``, 16 bytes). A page
computed by one worker is found by every other client of the same master. No metadata
server: the transfer engine runs in P2P-handshake mode, the master keeps the index.

A page is one store value: its K then its V, ``[2, layers, page_size, heads, dim]``. One
value, not two, so the store never holds half a page (it evicts values one by one: a K
without its V would answer ``exists`` and fail ``get``) and a lookup costs one key. Its
store key is ``kv/<layout tag>/<namespace>/<key hex>``: the caller's namespace (the model)
and the page layout (dtype and shape) are both in it, so two models or two layouts never
read each other's pages. The first ``put`` of a key wins; a later one keeps that value.

Every call is bounded: it runs on a daemon thread and the caller stops waiting at its own
deadline (``KvStoreTimeoutError``; ``kv_store_calls.py`` says why and how). A result that does
not confirm the transfer finished (e.g. ``TRANSFER_FAIL`` when the worker holding the page
died) retires that staging buffer for the life of the process and registers a fresh one
(``kv_store_staging.py``); after ``MAX_RETIRED_BUFFERS`` retirements the client refuses
further calls.

Two native calls hold the GIL while they wait, stalling every Python thread of the
process (measured on mooncake 0.3.13.post1): ``setup`` in ``KvStore(...)`` (a TCP probe
refuses an unreachable master at once; past it, at most ``MC_STORE_CLIENT_SETUP_RETRIES`` =
2 attempts of up to ~4.4 s each) and ``close`` (1-2 s for a client lending a segment, ~6 s
when the master does not answer, milliseconds for one lending none). Build the client when
the worker starts and close it when it stops, never on a step's path; ``exists``, ``put``
and ``get`` release the GIL.

Where a page lives: the master places each value in the segment of any client (at random),
so a page is lost when the client lending that segment leaves or dies (the master forgets
a dead client after ``--client_ttl``; until then ``exists`` answers True and ``get`` fails
with ``TRANSFER_FAIL``). When the segments are full a put is refused (``put`` answers False)
while the master evicts in the background; a page just put or read is not evicted for the
lease (``--default_kv_lease_ttl``).

Exposure: like the transfer engine (``services.transfer.mooncake_engine``), a store client
listens on every interface and authenticates nothing; whoever reaches its ports can read
and write its segment. ``kv_store_master.start_master`` binds the master to ``host``
(default loopback).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.exposure import MOONCAKE_EXPOSURE
from services.prefill.kv_store_calls import (
    MISSING,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    BoundedCalls,
    KvPagesMissingError,
    KvStoreUnavailableError,
    code_name,
    connect,
)
from services.prefill.kv_store_staging import StagingBuffers

if TYPE_CHECKING:
    from services.engine.kv_cache import KVPool

logger = logging.getLogger(__name__)

KEY_BYTES = 16  # a prefix-cache page key (services.common.prefix_keys)
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses a smaller segment (setup fails, -600)
_NAMESPACE = re.compile(r"[A-Za-z0-9._:@+/-]{1,200}")


@dataclass(frozen=True)
class PageLayout:
    """The shape of one KV page: what ``put`` takes and ``get`` returns, per page and per K/V."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)
        if min(dims) <= 0:
            raise ValueError(f"page layout dimensions must be positive, got {dims}")

    @classmethod
    def of(cls, pool: KVPool) -> PageLayout:
        return cls(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype)

    @property
    def tag(self) -> str:
        """Part of every store key: pages of different layouts never share an entry."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}-l{self.num_layers}-p{self.page_size}-h{self.num_kv_heads}-d{self.head_dim}"

    @property
    def value_shape(self) -> tuple[int, ...]:
        """One store value: ``[2 (K, V), layers, page_size, heads, dim]``."""
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def value_nbytes(self) -> int:
        n = 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim
        return n * self.dtype.itemsize

    def batch_shape(self, num_pages: int) -> tuple[int, ...]:
        """``k`` and ``v`` of ``num_pages`` pages: ``[layers, pages, page_size, heads, dim]``."""
        return (self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim)


class KvStore:
    """One client of the Mooncake store at ``master`` (``"host:port"``) for KV pages of
    ``layout`` under ``namespace`` (the model: pages of other namespaces are invisible).

    ``segment_bytes``: memory this process lends the store, 0 or at least 16 MiB (pages of
    every client may land there; they are lost when this client closes or dies).
    ``local_buffer_bytes``: Mooncake's own transfer buffer (unused by the calls here).
    ``max_pages_per_call``: pages per native call (a put and a get staging buffer of that
    many pages are allocated and registered); larger requests are split. ``timeout_s``: the
    default bound of each call. ``local_hostname``: the address other clients reach this
    one at. ``ImportError`` without Mooncake; ``KvStoreUnavailableError`` when the master
    cannot be reached or setup fails.
    """

    def __init__(
        self,
        master: str,
        namespace: str,
        layout: PageLayout,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 0,
        max_pages_per_call: int = 32,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                f"namespace must be 1-200 characters of [A-Za-z0-9._:@+/-], got {namespace!r}"
            )
        if segment_bytes != 0 and segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"segment_bytes must be 0 (lend none) or at least {MIN_SEGMENT_BYTES}, "
                f"got {segment_bytes}"
            )
        if local_buffer_bytes < 0 or max_pages_per_call <= 0:
            raise ValueError("local_buffer_bytes must be >= 0 and max_pages_per_call > 0")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master must be 'host:port', got {master!r}")
        store = connect(
            master,
            local_hostname=local_hostname,
            protocol=protocol,
            device_name=device_name,
            segment_bytes=segment_bytes,
            local_buffer_bytes=local_buffer_bytes,
            connect_timeout_s=connect_timeout_s,
        )
        self.master, self.namespace, self.layout = master, namespace, layout
        self.timeout_s, self.max_pages_per_call = timeout_s, max_pages_per_call
        self._prefix = f"kv/{layout.tag}/{namespace}/"
        self._store = store
        self._calls = BoundedCalls(("exists", "put", "get"), master)
        try:
            shape = (max_pages_per_call, *layout.value_shape)
            self._staging = StagingBuffers(store, self._calls, shape, layout.dtype)
        except BaseException:
            store.close()
            raise
        logger.warning(
            "%s (KV store client %s, segment %d bytes, master %s)",
            MOONCAKE_EXPOSURE,
            store.get_hostname(),
            segment_bytes,
            master,
        )

    def __enter__(self) -> KvStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def store_key(self, key: bytes) -> str:
        """The store's key of page ``key`` in this client's namespace and layout."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a page key has {KEY_BYTES} bytes, got {len(key)}")
        return self._prefix + key.hex()

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool]:
        """Per key, whether the store holds its page now (a page whose holder just died may
        answer True until the master drops that client, ``--client_ttl``)."""
        names = [self.store_key(key) for key in keys]
        if not names:
            return []
        deadline = self._deadline(timeout_s)

        def work() -> list[bool]:
            codes = self._store.batch_is_exist(names)
            bad = [code for code in codes if code < 0]
            if bad or len(codes) != len(names):
                raise KvStoreUnavailableError(
                    f"mooncake exists of {len(names)} pages failed: "
                    f"{code_name(bad[0]) if bad else f'{len(codes)} results'} "
                    f"(master {self.master})"
                )
            return [code == 1 for code in codes]

        return self._calls.run("exists", deadline, lambda: None, work)

    def put(
        self,
        keys: Sequence[bytes],
        k: torch.Tensor,
        v: torch.Tensor,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Store page ``i`` of ``k`` and ``v`` (``[layers, len(keys), page_size, heads,
        dim]``, this layout's dtype, any device) under ``keys[i]``. Per key: True when the
        store holds it after the call (put now or already there), False when the store had
        no room (it evicts in the background). The tensors are copied before this returns
        or raises, so the caller may reuse them at once."""
        names = [self.store_key(key) for key in keys]
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != self.layout.batch_shape(len(keys)) or t.dtype != self.layout.dtype:
                raise ValueError(
                    f"{name} must be {self.layout.dtype} "
                    f"{list(self.layout.batch_shape(len(keys)))}, got {t.dtype} {list(t.shape)}"
                )
        deadline = self._deadline(timeout_s)
        stored: list[bool] = []
        for begin in range(0, len(names), self.max_pages_per_call):
            end = min(begin + self.max_pages_per_call, len(names))
            stored += self._put_batch(names[begin:end], k[:, begin:end], v[:, begin:end], deadline)
        return stored

    def get(
        self, keys: Sequence[bytes], timeout_s: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``keys``' pages, ``[layers, len(keys), page_size, heads, dim]`` on the
        CPU, in the order asked. ``KvPagesMissingError`` (every missing key) when the store
        lacks any of them."""
        names = [self.store_key(key) for key in keys]
        shape = self.layout.batch_shape(len(keys))
        k_out = torch.empty(shape, dtype=self.layout.dtype)
        v_out = torch.empty(shape, dtype=self.layout.dtype)
        deadline = self._deadline(timeout_s)
        missing: list[bytes] = []
        for begin in range(0, len(names), self.max_pages_per_call):
            end = min(begin + self.max_pages_per_call, len(names))
            absent = self._get_batch(
                names[begin:end], k_out[:, begin:end], v_out[:, begin:end], deadline
            )
            missing += [keys[begin + i] for i in absent]
        if missing:
            raise KvPagesMissingError(missing, len(keys))
        return k_out, v_out

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse further calls, wait for the calls in flight (each ends within the RPC
        timeout), unregister the buffers and leave the store (pages in this client's segment
        go with it). True when done within ``timeout_s``; False: it goes on in the background
        (``wait_closed``). Mooncake's own close holds the GIL (1-2 s; ~6 s when the master
        does not answer), so this can return late by that much."""
        self._calls.close(self._staging.release)
        return self.wait_closed(self.timeout_s if timeout_s is None else timeout_s)

    def wait_closed(self, timeout_s: float) -> bool:
        return self._calls.wait_closed(timeout_s)

    # --- internals

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _put_batch(
        self, names: list[str], k: torch.Tensor, v: torch.Tensor, deadline: float
    ) -> list[bool]:
        n = len(names)
        nbytes = self.layout.value_nbytes

        def prepare() -> None:  # on the caller's thread: its tensors are never read later
            staging = self._staging["put"].tensor
            staging[:n, 0].copy_(k.transpose(0, 1))
            staging[:n, 1].copy_(v.transpose(0, 1))

        def work() -> list[bool]:
            base = self._staging["put"].ptr
            ptrs = [base + i * nbytes for i in range(n)]
            codes = self._staging.native(
                "put", names, lambda: self._store.batch_put_from(names, ptrs, [nbytes] * n)
            )
            bad = [
                c for c in codes if c < 0 and c not in (NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS)
            ]
            if bad:
                raise KvStoreUnavailableError(
                    f"mooncake put of {n} pages failed: {code_name(bad[0])} "
                    f"({len(bad)} pages; master {self.master})"
                )
            return [c != NO_AVAILABLE_HANDLE for c in codes]

        return self._calls.run("put", deadline, prepare, work)

    def _get_batch(
        self, names: list[str], k_out: torch.Tensor, v_out: torch.Tensor, deadline: float
    ) -> list[int]:
        """Fill ``k_out``/``v_out`` with ``names``' pages; the positions of those missing."""
        n = len(names)
        nbytes = self.layout.value_nbytes

        def work() -> list[int]:
            staging = self._staging["get"]
            ptrs = [staging.ptr + i * nbytes for i in range(n)]
            codes = self._staging.native(
                "get", names, lambda: self._store.batch_get_into(names, ptrs, [nbytes] * n)
            )
            absent = [i for i, c in enumerate(codes) if c in MISSING]
            bad = [c for c in codes if c != nbytes and c not in MISSING]
            if bad:
                what = code_name(bad[0]) if bad[0] < 0 else f"{bad[0]} bytes, not {nbytes}"
                raise KvStoreUnavailableError(
                    f"mooncake get of {n} pages failed: {what} ({len(bad)} pages; "
                    f"master {self.master})"
                )
            # copied out while the lock is held: an abandoned get fills tensors nobody reads
            k_out.copy_(staging.tensor[:n, 0].transpose(0, 1))
            v_out.copy_(staging.tensor[:n, 1].transpose(0, 1))
            return absent

        return self._calls.run("get", deadline, lambda: None, work)
