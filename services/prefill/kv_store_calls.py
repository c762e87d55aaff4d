"""How a ``KvStore`` (``kv_store.py``) calls Mooncake's native store client: its setup, its
registered staging buffers, what a call answers (Mooncake's result codes) or raises (the
errors below), and how long it may take.

Every call is bounded. The native calls block, with the GIL released, until the master
answers or its RPC timeout passes (``MC_RPC_TIMEOUT_MS``, set to 2 s unless the environment
says otherwise: ``CLIENT_ENV_DEFAULTS``; Mooncake's own default is 30 s, and after the master
dies a call waits ~4.4 s on reconnect attempts). So each call runs on a daemon thread and the
caller stops waiting at its own deadline (``KvStoreTimeoutError``). The abandoned call keeps
the lock of its kind (exists, put, get), and with it that kind's staging buffer, until it
returns, so nothing is reused under an unfinished transfer; the next call of that kind waits
for the lock within its own deadline."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from services.common.errors import UnavailableError

T = TypeVar("T")

INSTALL_HINT = (
    "install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU) "
    "and libibverbs1 librdmacm1 libnuma1"
)
# Set before ``setup`` unless already in the environment (the master RPC client reads them).
# Only the store library reads these; the transfer engine (``mooncake.engine``) does not.
CLIENT_ENV_DEFAULTS = {
    "MC_RPC_TIMEOUT_MS": "2000",  # per master RPC; Mooncake's default 30000
    "MC_RPC_CONNECT_TIMEOUT_MS": "1000",
    "MC_STORE_CLIENT_SETUP_RETRIES": "2",  # Mooncake's default 20: ~90 s on a dead master
}

# Mooncake ErrorCode values (mooncake-store/include/types.h); the binding returns plain ints.
NO_AVAILABLE_HANDLE = -200  # no room: every segment is full (eviction runs after)
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}
# Results after which no transfer is left in flight: it finished, or none was started (the
# master refused or did not answer before any byte moved). Anything else retires the buffer.
CONFIRMING = frozenset(
    {NO_AVAILABLE_HANDLE, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS}
    | {RPC_FAIL, RPC_TIMEOUT}
)
MISSING = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})


def code_name(code: int) -> str:
    return f"{_CODE_NAMES.get(code, 'ERROR')} ({code})"


class KvStoreError(UnavailableError):
    """The store could not do what was asked; the caller skips the tier for this page."""


class KvStoreUnavailableError(KvStoreError):
    """The master or the worker holding a page is unreachable, the store failed, or this
    client is closed or refuses calls."""


class KvStoreTimeoutError(KvStoreUnavailableError):
    """The call did not finish within its bound (it may still be running; its buffer is
    not reused until it returns)."""


class KvPagesMissingError(KvStoreError):
    """``get`` asked for pages the store does not hold (never put, evicted, their holder
    left, or still being written); ``missing`` are their keys in the order asked."""

    def __init__(self, missing: Sequence[bytes], asked: int) -> None:
        self.missing = tuple(missing)
        shown = ", ".join(key.hex() for key in self.missing[:4])
        more = f" and {len(self.missing) - 4} more" if len(self.missing) > 4 else ""
        super().__init__(
            f"{len(self.missing)} of {asked} KV pages are not in the store: {shown}{more}"
        )


def connect(
    master: str,
    *,
    local_hostname: str,
    protocol: str,
    device_name: str,
    segment_bytes: int,
    local_buffer_bytes: int,
    connect_timeout_s: float,
) -> Any:
    """A ``MooncakeDistributedStore`` set up against ``master`` (``"host:port"``, checked by
    the caller) in P2P-handshake mode. ``ImportError`` without Mooncake;
    ``KvStoreUnavailableError`` when the master cannot be reached or setup fails."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # the wheel, or a shared library it links
        raise ImportError(f"Mooncake store unavailable ({exc}): {INSTALL_HINT}") from exc
    host, _, port = master.rpartition(":")
    try:  # an unreachable master fails fast here instead of in setup (which holds the GIL)
        socket.create_connection((host.strip("[]"), int(port)), connect_timeout_s).close()
    except OSError as exc:
        raise KvStoreUnavailableError(f"mooncake master {master} is not reachable: {exc}") from exc
    for name, value in CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    store = MooncakeDistributedStore()
    rc = store.setup(
        local_hostname,
        "P2PHANDSHAKE",
        segment_bytes,
        local_buffer_bytes,
        protocol,
        device_name,
        master,
    )
    if rc != 0:
        store.close()  # what setup started (its transfer engine); safe after a failure
        raise KvStoreUnavailableError(
            f"mooncake store setup against master {master} failed ({code_name(rc)})"
        )
    return store


class StagingBuffer:
    """A registered host buffer of ``shape`` (store values, one a row), one per kind of
    transfer."""

    def __init__(self, store: Any, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
        self.tensor = torch.empty(shape, dtype=dtype)
        self.ptr = self.tensor.data_ptr()
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        rc = store.register_buffer(self.ptr, self.nbytes)
        if rc != 0:
            raise KvStoreUnavailableError(
                f"mooncake register_buffer of the {what} staging buffer ({self.nbytes} bytes) "
                f"failed: {code_name(rc)}"
            )


class BoundedCalls:
    """The native calls of one store client (at ``master``), one lock per kind of call in
    ``kinds``: each call runs on a daemon thread that its caller waits for until its deadline.
    ``refuse`` and ``close`` turn later calls away (``KvStoreUnavailableError``)."""

    def __init__(self, kinds: Iterable[str], master: str) -> None:
        self.master = master
        self.refusing: str | None = None  # why calls are refused (closed, broken)
        self._locks = {what: threading.Lock() for what in kinds}
        self._state = threading.Lock()
        self._closing: threading.Thread | None = None

    def run(
        self, what: str, deadline: float, prepare: Callable[[], None], work: Callable[[], T]
    ) -> T:
        """``prepare`` here and then ``work`` on a daemon thread, both holding ``what``'s lock
        (released when ``work`` returns, even after the caller stopped waiting). ``deadline``
        is monotonic; past it, ``KvStoreTimeoutError``."""
        self.check_usable()
        lock = self._locks[what]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise KvStoreTimeoutError(
                f"mooncake {what}: an earlier {what} of this client is still running past "
                f"its deadline (master {self.master} slow or unreachable)"
            )
        try:
            self.check_usable()
            prepare()
        except BaseException:
            lock.release()
            raise
        outcome: list[tuple[bool, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, work()))
            except BaseException as exc:  # handed to the waiting caller below
                outcome.append((False, exc))
            finally:
                lock.release()
                done.set()

        threading.Thread(target=run, name=f"kv-store-{what}", daemon=True).start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise KvStoreTimeoutError(
                f"mooncake {what} did not finish before its deadline "
                f"(master {self.master} slow or unreachable)"
            )
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def check_usable(self) -> None:
        if self.refusing is not None:
            raise KvStoreUnavailableError(f"KV store client is {self.refusing}")

    def refuse(self, why: str) -> None:
        """Turn every later call away, saying the client is ``why``."""
        self.refusing = why

    def close(self, release: Callable[[], None]) -> None:
        """Refuse further calls and, on a daemon thread, wait for the calls in flight (each
        ends within the RPC timeout), then ``release()``. Only the first close does this."""
        with self._state:
            if self._closing is None:
                self.refusing = self.refusing or "closed"
                self._closing = threading.Thread(
                    target=self._close, args=(release,), name="kv-store-close", daemon=True
                )
                self._closing.start()

    def wait_closed(self, timeout_s: float) -> bool:
        assert self._closing is not None, "close() first"
        self._closing.join(timeout_s)
        return not self._closing.is_alive()

    def _close(self, release: Callable[[], None]) -> None:
        for lock in self._locks.values():
            lock.acquire()
        release()
