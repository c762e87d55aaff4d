"""One plan's KV writes from one rank into decode's pages.

Every rank that ran the plan holds the whole KV of each request (of its KV heads: a
tensor-parallel rank writes its heads into those heads of decode's pages); of its pages ``p``
(position order) CP rank ``r`` of ``C`` writers writes those with ``p % C == r`` (a plan one
CP rank runs alone: that rank writes them all). Writes are begun for every request before
any is awaited, so an asynchronous backend queues them back to back; a backend that
``streams_layers`` is begun before the forward (``begin_layerwise``) and fed each layer.
``close`` cancels what a failed forward left begun.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from services.common.destinations import KvDestination
from services.common.errors import StageServeError
from services.engine.model_runner import ModelRunner
from services.prefill.messages import RankOutcome, RankRequest
from services.transfer.base import (
    BaseKVSender,
    LayerwiseSend,
    PendingSend,
    pool_layout,
    shares_heads,
)

logger = logging.getLogger(__name__)


def owned_pages(num_pages: int, writer: int, num_writers: int) -> list[int]:
    """Page indices (position order) that ``writer`` of ``num_writers`` writes."""
    return list(range(writer, num_pages, num_writers))


@dataclass
class _Write:
    handle: PendingSend | LayerwiseSend | None = None
    error: StageServeError | None = None  # it could not start


class KvHandoff:
    def __init__(
        self,
        runner: ModelRunner,
        sender: BaseKVSender,
        writer: int,
        num_writers: int,
        deadlines: dict[str, float],
        writes: bool = True,
    ) -> None:
        """``writes`` False: this rank writes nothing (a TP rank whose KV heads another rank of
        its group writes)."""
        self.runner, self.sender = runner, sender
        self.writes = writes
        self.writer, self.num_writers = writer, num_writers
        self._deadlines = deadlines  # request_id -> time.monotonic() deadline of its write
        self._layout = pool_layout(runner.kv_pool)
        # (request_id, decode pool index) -> its write; a request's pools in TP rank order
        self._writes: dict[tuple[str, int], _Write] = {}

    def begin_layerwise(self, requests: Sequence[RankRequest]) -> None:
        for request in requests:
            for index, src, dst in self._targets(request):
                self._begin(request.request_id, index, src, dst, layerwise=True)

    def layer_done(self, layer: int) -> None:
        for write in self._writes.values():
            if isinstance(write.handle, LayerwiseSend):
                write.handle.layer_done(layer)

    def start(self, requests: Sequence[RankRequest]) -> None:
        """After the forward: finish the layer-streamed writes, begin the others."""
        for request in requests:
            for index, src, dst in self._targets(request):
                write = self._writes.get((request.request_id, index))
                if write is None:
                    self._begin(request.request_id, index, src, dst, layerwise=False)
                elif isinstance(write.handle, LayerwiseSend):
                    try:
                        write.handle = write.handle.finish()
                    except StageServeError as exc:
                        write.handle, write.error = None, exc

    def wait(
        self, requests: Sequence[RankRequest], token_ids: dict[str, int]
    ) -> tuple[RankOutcome, ...]:
        return tuple(self._wait(r, token_ids.get(r.request_id, -1)) for r in requests)

    def close(self) -> None:
        """Cancel layer-streamed writes still open (a failed forward)."""
        for write in self._writes.values():
            if isinstance(write.handle, LayerwiseSend):
                write.handle.cancel()  # the layers already queued still land (decode quarantines)
        self._writes.clear()

    def _targets(self, request: RankRequest) -> list[tuple[int, list[int], KvDestination]]:
        """``(pool index, source pages, destination)`` of each of decode's pools this rank
        writes: its share of the pages, in each pool that holds some of its KV heads."""
        if not self.writes:
            return []
        pages = self.runner.page_table.pages(request.request_id)
        mine = owned_pages(len(request.kv_dst.page_ids), self.writer, self.num_writers)
        if not mine:
            return []
        src = [pages[p] for p in mine]
        return [
            (
                index,
                src,
                msgspec.structs.replace(dst, page_ids=tuple(dst.page_ids[p] for p in mine)),
            )
            for index, dst in enumerate(request.kv_dsts)
            if shares_heads(self._layout, dst.layout)
        ]

    def _begin(
        self, request_id: str, index: int, src: list[int], dst: KvDestination, layerwise: bool
    ) -> None:
        write = self._writes[request_id, index] = _Write()
        start = self.sender.start_layerwise if layerwise else self.sender.start
        try:
            write.handle = start(
                request_id, self.runner.kv_pool, src, dst, self._deadlines[request_id]
            )
        except StageServeError as exc:
            write.error = exc

    def _wait(self, request: RankRequest, token_id: int) -> RankOutcome:
        """Every write of the request waited for; the first failure is its outcome's error."""
        request_id = request.request_id
        writes = [self._writes.pop(key) for key in list(self._writes) if key[0] == request_id]
        num_bytes, elapsed_s, error = 0, 0.0, None
        for write in writes:
            try:
                if write.error is not None:
                    raise write.error
                if isinstance(write.handle, PendingSend):
                    result = write.handle.wait()
                    num_bytes += result.num_bytes
                    elapsed_s = max(elapsed_s, result.elapsed_s)
            except StageServeError as exc:
                logger.warning("KV transfer of %s failed: %s", request_id, exc.message)
                error = error or exc
        if error is not None:
            return RankOutcome(
                request_id, token_id, error=error.message, error_type=type(error).__name__
            )
        return RankOutcome(request_id, token_id, num_bytes, elapsed_s)
