"""The leader's handles of a DP-attention group's DP ranks (``dp_attention.py``): D views of one
free-running rank group of D processes.

A view posts its commands tagged with its DP rank (the group's rank 0 hands them on); each
report of the group (``DpReports``) goes to every view as its own rank's ``RankReport``,
covering the same posts (sequence numbers are the group's, so each view's posts up to a report's
``through_seq`` are the ones it applied). A failed step, a lost group and readiness reach every
view alike: the DP ranks share their collectives, so they fail and re-form together. Starting
or closing any view starts or closes the group, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import msgspec

from services.common.ranks.free_supervisor import Reported
from services.decode.messages import DpReports, RankCommands

OnReady = Callable[[bool], None]
OnReport = Callable[[Reported], None]
MakeGroup = Callable[[OnReady, OnReport], "GroupHandle"]


class GroupHandle:  # what a view needs of the group (services.common.ranks.group.RankGroup)
    is_ready: bool

    async def start(self) -> None: ...

    def post(self, payload: msgspec.Struct) -> int: ...

    async def aclose(self) -> None: ...


class SharedGroup:
    """One group behind ``size`` views; built by ``make_group`` once every view exists."""

    def __init__(self, size: int, make_group: MakeGroup) -> None:
        self.size = size
        self._make_group = make_group
        self._callbacks: dict[int, tuple[OnReady, OnReport]] = {}
        self._group: GroupHandle | None = None
        self._start: asyncio.Task[None] | None = None
        self._close: asyncio.Task[None] | None = None

    def view(self, dp_rank: int, on_ready: OnReady, on_report: OnReport) -> DpRankView:
        assert 0 <= dp_rank < self.size and dp_rank not in self._callbacks
        self._callbacks[dp_rank] = (on_ready, on_report)
        return DpRankView(self, dp_rank)

    @property
    def group(self) -> GroupHandle:
        if self._group is None:
            assert len(self._callbacks) == self.size, "every view is made before the group"
            self._group = self._make_group(self._on_ready, self._on_report)
        return self._group

    def _on_ready(self, is_ready: bool) -> None:
        for on_ready, _ in self._callbacks.values():
            on_ready(is_ready)

    def _on_report(self, reported: Reported) -> None:
        result = reported.result
        for dp_rank, (_, on_report) in sorted(self._callbacks.items()):
            if isinstance(result, DpReports):
                on_report(dataclasses.replace(reported, result=result.reports[dp_rank]))
            else:
                on_report(reported)

    async def start(self) -> None:
        if self._start is None:
            self._start = asyncio.ensure_future(self.group.start())
        await asyncio.shield(self._start)

    async def aclose(self) -> None:
        if self._close is None:
            self._close = asyncio.ensure_future(self.group.aclose())
        await asyncio.shield(self._close)


class DpRankView:
    """DP rank ``dp_rank`` of a shared group, as the leader's ``RankHandle``."""

    def __init__(self, shared: SharedGroup, dp_rank: int) -> None:
        self.shared = shared
        self.dp_rank = dp_rank

    @property
    def is_ready(self) -> bool:
        return self.shared.group.is_ready

    async def start(self) -> None:
        await self.shared.start()

    def post(self, payload: msgspec.Struct) -> int:
        assert isinstance(payload, RankCommands)
        return self.shared.group.post(msgspec.structs.replace(payload, dp_rank=self.dp_rank))

    async def aclose(self) -> None:
        await self.shared.aclose()
