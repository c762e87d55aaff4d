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
from services.transfer.base import BaseKVSender, LayerwiseSend, PendingSend

logger = logging.getLogger(__name__)


def owned_pages(num_pages: int, writer: int, num_writers: int) -> list[int]:
    """Page indices (position order) that ``writer`` of ``num_writers`` writes."""
    return list(range(writer, num_pages, num_writers))


@dataclass
class _Write:
    handle: PendingSend | LayerwiseSend | None = None  # None: nothing of this request is ours
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
        self._writes: dict[str, _Write] = {}

    def begin_layerwise(self, requests: Sequence[RankRequest]) -> None:
        for request in requests:
            self._begin(request, layerwise=True)

    def layer_done(self, layer: int) -> None:
        for write in self._writes.values():
            if isinstance(write.handle, LayerwiseSend):
                write.handle.layer_done(layer)

    def start(self, requests: Sequence[RankRequest]) -> None:
        """After the forward: finish the layer-streamed writes, begin the others."""
        for request in requests:
            write = self._writes.get(request.request_id)
            if write is None:
                self._begin(request, layerwise=False)
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

    def _mine(self, request: RankRequest) -> tuple[list[int], KvDestination]:
        if not self.writes:
            return [], request.kv_dst
        pages = self.runner.page_table.pages(request.request_id)
        mine = owned_pages(len(request.kv_dst.page_ids), self.writer, self.num_writers)
        dst = msgspec.structs.replace(
            request.kv_dst, page_ids=tuple(request.kv_dst.page_ids[p] for p in mine)
        )
        return [pages[p] for p in mine], dst

    def _begin(self, request: RankRequest, layerwise: bool) -> None:
        src, dst = self._mine(request)
        write = self._writes[request.request_id] = _Write()
        if not src:
            return
        start = self.sender.start_layerwise if layerwise else self.sender.start
        try:
            write.handle = start(
                request.request_id,
                self.runner.kv_pool,
                src,
                dst,
                self._deadlines[request.request_id],
            )
        except StageServeError as exc:
            write.error = exc

    def _wait(self, request: RankRequest, token_id: int) -> RankOutcome:
        write = self._writes.pop(request.request_id)
        try:
            if write.error is not None:
                raise write.error
            if not isinstance(write.handle, PendingSend):
                return RankOutcome(request.request_id, token_id)
            result = write.handle.wait()
        except StageServeError as exc:
            logger.warning("KV transfer of %s failed: %s", request.request_id, exc.message)
            return RankOutcome(
                request.request_id, token_id, error=exc.message, error_type=type(exc).__name__
            )
        return RankOutcome(request.request_id, token_id, result.num_bytes, result.elapsed_s)
