"""The prefix cache's third tier: a KV store shared by every prefill worker (``kv_store.py``).

The leader asks the store how many leading page keys of a request it holds (``StoreLookup``,
once per request, before the request is planned, bounded in time) and plans with that
answer like any other: ranks that lack those pages fetch them into device pages at the
start of the step (``PrefixPages.apply``), so every rank reads the same pages and no rank
decides anything from what it finds. A fetch that fails fails the step on every rank (the
ranks agree on errors); the leader runs its requests again without the store. One rank of
each plan hands the pages the plan computed to its ``StoreWriter``, which writes them in
the background: a write never holds up a step, and one that fails is counted and dropped.
A store that is down costs each request one bounded lookup and is otherwise skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger(__name__)
MAX_PENDING_WRITES = 64  # batches a writer holds; more are dropped (counted)


class Store(Protocol):
    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get(self, keys: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def put(self, keys: Sequence[bytes], k: torch.Tensor, v: torch.Tensor) -> object: ...

    def close(self) -> object: ...


class StoreLookup:
    """The leader's question to the store: how many leading keys it holds (0 when it fails or
    does not answer within ``timeout_s``; ``on_failure`` counts it). ``connect`` makes the
    client at the first question, and again ``retry_s`` after a failed try. After a failed
    question the next ``retry_s`` are answered 0 at once: a store that is down costs one
    request the bound, not every request."""

    def __init__(
        self,
        connect: Callable[[], Store],
        timeout_s: float,
        on_failure: Callable[[str], None] = lambda _: None,
        retry_s: float = 5.0,
    ) -> None:
        self.timeout_s, self.on_failure, self.retry_s = timeout_s, on_failure, retry_s
        self._connect = connect
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._next_try_mono = 0.0  # no connection attempt before it
        self._skip_until_mono = 0.0  # no question before it (the last one failed)

    def _exists(self, keys: list[bytes]) -> list[bool]:
        with self._lock:  # one connection attempt at a time, on this worker thread
            if self._store is None:
                if time.monotonic() < self._next_try_mono:
                    raise ConnectionError("not connected to the KV store (trying again soon)")
                try:
                    self._store = self._connect()
                except Exception:
                    self._next_try_mono = time.monotonic() + self.retry_s
                    raise
            store = self._store
        return store.exists(keys)

    async def leading(self, keys: Sequence[bytes]) -> int:
        if time.monotonic() < self._skip_until_mono:
            return 0
        try:
            async with asyncio.timeout(self.timeout_s):
                found = await asyncio.to_thread(self._exists, list(keys))
        except Exception as exc:  # down, slow or refusing: the tier is skipped for this request
            logger.warning("KV store lookup failed: %s", exc or type(exc).__name__)
            self.on_failure("lookup")
            self._skip_until_mono = time.monotonic() + self.retry_s
            return 0
        return next((i for i, present in enumerate(found) if not present), len(found))

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def model_namespace(model_dir: Path) -> str:
    """The store namespace of the checkpoint in ``model_dir``: a digest of its config and of
    each weight file's name, size, first and last MiB, so two checkpoints (random weights of
    one shape included) never read each other's pages."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return f"{model_dir.name[:64]}@{digest.hexdigest()[:16]}"


# a queued write: its keys, K, V and (GPU) the event after which K and V may be read
_Write = tuple[list[bytes], torch.Tensor, torch.Tensor, torch.cuda.Event | None]


class StoreWriter:
    """A rank's store: ``get`` in the step; ``put_later`` queues the write for one background
    thread (``close`` ends it)."""

    def __init__(self, store: Store, on_failure: Callable[[str], None] = lambda _: None) -> None:
        self.store, self.on_failure = store, on_failure
        self._queue: queue.Queue[_Write | None] = queue.Queue(MAX_PENDING_WRITES)
        self._thread = threading.Thread(target=self._write_forever, name="kv-store-writer")
        self._thread.daemon = True
        self._thread.start()

    def get(self, keys: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.get(list(keys))

    def put_later(
        self,
        keys: Sequence[bytes],
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue the write; never waits. ``ready`` (a GPU rank's): ``k`` and ``v`` are host
        memory a copy on a side stream is filling; the writer thread waits on this event
        before it reads them."""
        try:
            self._queue.put_nowait((list(keys), k, v, ready))
        except queue.Full:
            logger.warning("KV store writes are behind: %d pages not written", len(keys))
            self.on_failure("write")

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write was tried (tests); False after ``timeout_s``."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def close(self) -> None:
        """Stop writing (what is queued is tried first, within a bound) and leave the store."""
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self.store.close()

    def _write_forever(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            finally:
                # its pages (pinned on a GPU) go back to the allocator now, not at the next write
                del item
                self._queue.task_done()
        self._queue.task_done()

    def _write(
        self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the copy into k and v landed (the GIL is released)
            self.store.put(keys, k, v)
        except Exception as exc:
            logger.warning("KV store write of %d pages failed: %s", len(keys), exc)
            self.on_failure("write")
