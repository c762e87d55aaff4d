"""KV handoff contracts: wire types, descriptor math, sender/receiver.

Lifecycle of one request's KV handoff (decode owns the pages):

  decode: pages = page_table.reserve(...)
          destination = receiver.destination(request_id, pages)
            -> travels to prefill (msgspec, via the router, signed in a KvRef)
  prefill: sender.send(request_id, pool, src_pages, destination, deadline)
            -> one batched write of every layer x {K, V} x page run, then "KV ready"
  decode: the request's generate message carries prefill's proof that the write landed;
          a reservation that expires or is aborted before it releases its pages

A write that missed its deadline may still land in the pages until the engine's own
transfer timeout passes (Mooncake: ``MC_TRANSFER_TIMEOUT``, default 30 s), so decode's
scheduler puts such pages in quarantine (``--kv-quarantine-s``) rather than on the free list.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import DeadlineExceededError, InvalidRequestError
from services.engine.kv_cache import KVPool

Clock = Callable[[], float]  # monotonic seconds


class TransferPlan(msgspec.Struct, frozen=True):
    """Batched descriptors: copy ``lengths[i]`` bytes from ``src_addrs[i]`` to ``dst_addrs[i]``."""

    src_addrs: tuple[int, ...]
    dst_addrs: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(self.lengths)

    @property
    def num_descriptors(self) -> int:
        return len(self.lengths)


class TransferResult(msgspec.Struct, frozen=True):
    request_id: str
    num_bytes: int
    num_descriptors: int
    elapsed_s: float


def pool_layout(pool: KVPool) -> KvPoolLayout:
    (k_base, _), (v_base, _) = pool.memory_regions()
    return KvPoolLayout(
        k_base=k_base,
        v_base=v_base,
        num_layers=pool.num_layers,
        num_pages=pool.num_pages,
        page_size=pool.page_size,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        dtype=str(pool.dtype).removeprefix("torch."),
        page_nbytes=pool.page_nbytes,
        head_start=pool.head_start,
    )


HeadSlices = tuple[slice, slice]  # (the source pool's heads, the destination's) to copy
# pages move as they are stored: both ends hold them the same way, or nothing moves
_LAYOUT_HINTS = {"dtype": " (prefill and decode need the same --dtype and --kv-cache-dtype)"}


def check_compatible(
    src: KvPoolLayout, src_pages: Sequence[int], dst: KvDestination
) -> HeadSlices | None:
    """Raise ``InvalidRequestError`` unless ``src_pages`` of ``src`` can be written into ``dst``;
    return the KV heads to copy, or None when both pools hold the same heads (whole pages move).

    A tensor-parallel rank's pool holds ``num_kv_heads`` of the model's heads from its
    ``head_start``: the heads both pools hold are copied, each pool's own slice of them.
    """
    for field in ("num_layers", "page_size", "head_dim", "dtype"):
        if getattr(src, field) != getattr(dst.layout, field):
            raise InvalidRequestError(
                f"KV layout mismatch for {dst.request_id}: {field} is {getattr(src, field)} here, "
                f"{getattr(dst.layout, field)} at the destination{_LAYOUT_HINTS.get(field, '')}"
            )
    heads = _common_heads(src, dst)
    if len(src_pages) != len(dst.page_ids):
        raise InvalidRequestError(
            f"{dst.request_id}: {len(src_pages)} source pages for "
            f"{len(dst.page_ids)} destination pages"
        )
    # builtins, not numpy: this runs on every send, and converting the tuples costs more than
    # the checks
    if len(set(dst.page_ids)) != len(dst.page_ids):
        raise InvalidRequestError(f"{dst.request_id}: duplicate destination pages {dst.page_ids}")
    for pages, num_pages in ((src_pages, src.num_pages), (dst.page_ids, dst.layout.num_pages)):
        if len(pages) and (min(pages) < 0 or max(pages) >= num_pages):
            raise InvalidRequestError(
                f"{dst.request_id}: page outside [0, {num_pages}) in {list(pages)}"
            )
    return heads


def shares_heads(src: KvPoolLayout, dst: KvPoolLayout) -> bool:
    """Whether the two pools hold a KV head in common."""
    return max(src.head_start, dst.head_start) < min(
        src.head_start + src.num_kv_heads, dst.head_start + dst.num_kv_heads
    )


def _common_heads(src: KvPoolLayout, dst: KvDestination) -> HeadSlices | None:
    d = dst.layout
    if (src.head_start, src.num_kv_heads) == (d.head_start, d.num_kv_heads):
        if src.page_nbytes != d.page_nbytes:
            raise InvalidRequestError(
                f"KV layout mismatch for {dst.request_id}: page_nbytes is {src.page_nbytes} "
                f"here, {d.page_nbytes} at the destination"
            )
        return None
    if not shares_heads(src, d):
        raise InvalidRequestError(
            f"KV layout mismatch for {dst.request_id}: KV heads {_heads(src)} here, "
            f"{_heads(d)} at the destination: none in common"
        )
    lo = max(src.head_start, d.head_start)
    hi = min(src.head_start + src.num_kv_heads, d.head_start + d.num_kv_heads)
    return slice(lo - src.head_start, hi - src.head_start), slice(
        lo - d.head_start, hi - d.head_start
    )


def _heads(layout: KvPoolLayout) -> str:
    return f"{layout.head_start}..{layout.head_start + layout.num_kv_heads - 1}"


def whole_pages(heads: HeadSlices | None, backend: str, request_id: str) -> None:
    """``InvalidRequestError`` for a write of some of each page's heads through ``backend``,
    which moves whole pages only."""
    if heads is not None:
        raise InvalidRequestError(
            f"{request_id}: the {backend} KV backend moves whole pages, and the two pools hold "
            "different KV heads (tensor parallelism): use the shm or inprocess KV backend"
        )


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, num_pages)`` runs where both sides advance by one page."""
    assert len(src_pages) == len(dst_pages)
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def plan_transfer(src: KvPoolLayout, src_pages: Sequence[int], dst: KvDestination) -> TransferPlan:
    """Descriptors for every layer x {K, V} x page run, with byte-adjacent descriptors merged;
    ``src`` holds the destination's every KV head (``whole_pages``)."""
    whole_pages(check_compatible(src, src_pages, dst), "mooncake", dst.request_id)
    nbytes = src.page_nbytes
    descs: list[list[int]] = []  # [src_addr, dst_addr, length]
    runs = page_runs(src_pages, dst.page_ids)
    for src_base, dst_base in ((src.k_base, dst.layout.k_base), (src.v_base, dst.layout.v_base)):
        for layer in range(src.num_layers):
            src_layer = src_base + layer * src.num_pages * nbytes
            dst_layer = dst_base + layer * dst.layout.num_pages * nbytes
            for src_page, dst_page, num_pages in runs:
                src_addr = src_layer + src_page * nbytes
                dst_addr = dst_layer + dst_page * nbytes
                prev = descs[-1] if descs else None
                if prev and prev[0] + prev[2] == src_addr and prev[1] + prev[2] == dst_addr:
                    prev[2] += num_pages * nbytes
                else:
                    descs.append([src_addr, dst_addr, num_pages * nbytes])
    columns = tuple(zip(*descs, strict=True)) or ((), (), ())  # (src_addrs, dst_addrs, lengths)
    return TransferPlan(*columns)


def check_deadline(
    request_id: str, deadline_mono: float, what: str = "KV", clock: Clock = time.monotonic
) -> float:
    """Seconds left before ``deadline``; ``DeadlineExceededError`` naming the ``what`` transfer
    (KV, embedding) when none are."""
    remaining = deadline_mono - clock()
    if remaining <= 0:
        raise DeadlineExceededError(f"{what} transfer for {request_id} passed its deadline")
    return remaining


def check_backend(request_id: str, backend: str, dst: KvDestination | Any) -> None:
    """``InvalidRequestError`` unless ``dst`` (a KV or embedding destination) is ``backend``'s."""
    if dst.backend != backend:
        raise InvalidRequestError(
            f"{request_id}: a {dst.backend} destination for the {backend} sender"
        )


class PublishedSession:
    """Receiver mixin: ``session_id`` is what ``register`` put in ``_session_id``."""

    _registers: str  # what ``register`` takes ("pool", "buffer"), named when read too early

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._session_id: str | None = None

    @property
    def session_id(self) -> str:
        assert self._session_id is not None, f"register({self._registers}) first"
        return self._session_id


class PendingSend(ABC):
    """A KV write ``BaseKVSender.start`` began; ``wait`` returns once its bytes landed."""

    @abstractmethod
    def wait(self) -> TransferResult:
        """Block until the write finished; raises what ``send`` raises (the deadline holds)."""


class CompletedSend(PendingSend):
    """A write that already finished when ``start`` returned."""

    def __init__(self, result: TransferResult) -> None:
        self.result = result

    def wait(self) -> TransferResult:
        return self.result


class LayerwiseSend(ABC):
    """A KV write going out while the forward filling the pages still runs (``start_layerwise``).

    The forward calls ``layer_done(i)`` once layer i's kernels are queued; the backend may
    queue that layer's copy behind them right away (the link then carries the KV while later
    layers compute and stays awake). ``finish`` queues what is left and returns the write as
    ``start`` would; ``cancel`` queues nothing more (the forward failed). Either must be called
    once: both leave the pages safe to free and reuse on the forward's stream.
    """

    @abstractmethod
    def layer_done(self, layer: int) -> None: ...

    @abstractmethod
    def finish(self) -> PendingSend: ...

    @abstractmethod
    def cancel(self) -> None: ...


class BaseKVSender(ABC):
    """Prefill side: writes a request's KV pages into a remote decode pool."""

    backend: str
    streams_layers = (
        False  # whether prefill should use start_layerwise (before the forward) over start
    )

    def register(self, pool: KVPool) -> None:
        """Make ``pool`` a valid source (register its memory); idempotent. Default: nothing."""
        del pool

    @abstractmethod
    def send(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> TransferResult:
        """Write page ``src_pages[i]`` of every layer of K and V into ``dst.page_ids[i]``, batched.

        ``deadline`` is ``time.monotonic()`` seconds. Returns after the bytes landed. Raises
        ``InvalidRequestError`` (layouts or page counts disagree), ``UnavailableError`` (peer
        unreachable or the write failed) or ``DeadlineExceededError``.
        """

    def start(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> PendingSend:
        """Begin the write ``send`` does; ``wait()`` on the result finishes it.

        A caller with several requests starts them all, then waits for each: a backend whose
        writes run asynchronously (``cuda_ipc``) queues them back to back, so one request's
        host work overlaps another's bytes on the link. Errors found before the write began
        raise here, the rest from ``wait``. Default: the whole write happens here.
        """
        return CompletedSend(self.send(request_id, src_pool, src_pages, dst, deadline_mono))

    def start_layerwise(
        self,
        request_id: str,
        src_pool: KVPool,
        src_pages: Sequence[int],
        dst: KvDestination,
        deadline_mono: float,
    ) -> LayerwiseSend:
        """Begin the write before the forward that fills ``src_pages`` (see ``LayerwiseSend``).

        Only for a backend that ``streams_layers`` (``cuda_ipc``: a GPU kernel on the forward's
        device is as cheap to queue early as late); checks and errors as ``start``. A request
        aborted mid-forward may still have layers land in decode's pages: decode's quarantine
        covers them as it covers a write that missed its deadline.
        """
        raise NotImplementedError(
            f"the {self.backend} KV backend writes after the forward (streams_layers is False)"
        )

    def close(self) -> None:
        """Release engine resources; the sender is unusable afterwards. Default: nothing held."""
        return None


class BaseKVReceiver(ABC):
    """Decode side: registers its pool once and describes its pages to senders."""

    backend: str
    _registers = "pool"

    def __init__(self) -> None:
        self._pool: KVPool | None = None

    @property
    @abstractmethod
    def session_id(self) -> str:
        """Address senders use to reach this receiver's engine."""

    @abstractmethod
    def _register_memory(self, pool: KVPool) -> None: ...

    @abstractmethod
    def _unregister_memory(self, pool: KVPool) -> None: ...

    def register(self, pool: KVPool) -> None:
        """Register ``pool`` with the engine; once per receiver, before any ``destination``."""
        assert self._pool is None, "a receiver registers exactly one KV pool"
        self._register_memory(pool)
        self._pool = pool

    def destination(self, request_id: str, pages: Sequence[int]) -> KvDestination:
        """The wire description prefill needs to write ``pages`` (position order) of this pool."""
        assert self._pool is not None, "register(pool) before asking for destinations"
        return KvDestination(
            backend=self.backend,
            session_id=self.session_id,
            request_id=request_id,
            layout=pool_layout(self._pool),
            page_ids=tuple(pages),
        )

    def close(self) -> None:
        """Unregister the pool; the receiver is unusable afterwards."""
        if self._pool is not None:
            self._unregister_memory(self._pool)
            self._pool = None
