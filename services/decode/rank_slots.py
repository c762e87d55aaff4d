"""The leader's view of each DP rank: its handle, its last load, its command queue, placement.

A command for a rank waits in the rank's queue until the rank's next step carries it; a
Reserve's pages count against the rank from the moment it is queued until the report of
that step (which includes them), so a burst of Reserves spreads over the ranks before any
of them reports. Owned by the leader's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from services.common.errors import UnavailableError
from services.decode.messages import Command, RankLoad, Reply, ReserveCommand


class RankHandle(Protocol):
    """What the leader needs of one rank's group (``services.common.ranks.group.RankGroup``)."""

    @property
    def is_ready(self) -> bool: ...

    async def start(self) -> None: ...

    def submit(self, payload: msgspec.Struct, timeout_s: float | None = None) -> Future[Any]: ...

    async def aclose(self) -> None: ...


MakeRank = Callable[
    [int, Callable[[bool], None]], RankHandle
]  # (dp_rank, on_ready_change) -> handle


@dataclass
class Queued:
    command: Command
    reply: asyncio.Future[Reply] | None  # None: nobody waits for it
    num_pages: int = 0  # a Reserve's pages, counted against the rank until its report


@dataclass
class RankSlot:
    dp_rank: int
    handle: RankHandle
    load: RankLoad | None = None  # from its last report; None until its first after (re)forming
    is_busy: bool = False  # its last report said it has work: step again at once
    queue: list[Queued] = field(default_factory=list)
    num_pending_pages: int = 0  # pages of Reserves queued or sent, not yet reported
    num_pending_requests: int = 0
    waiting_listed_mono: float = 0.0  # when its waiting requests were last listed (streams.py)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    driver: asyncio.Task | None = None

    @property
    def is_serving(self) -> bool:
        return self.handle.is_ready and self.load is not None

    def send(
        self, command: Command, reply: asyncio.Future[Reply] | None, num_pages: int = 0
    ) -> None:
        """Queue ``command`` for the rank's next step; ``reply`` gets its answer."""
        if isinstance(command, ReserveCommand):
            self.num_pending_pages += num_pages
            self.num_pending_requests += 1
        self.queue.append(Queued(command, reply, num_pages))
        self.wake.set()

    def take(self) -> list[Queued]:
        queued, self.queue = self.queue, []
        return queued

    def settle(self, queued: list[Queued], replies: Sequence[Reply] | None) -> None:
        """The step carrying ``queued`` ended: its replies in order, or None (it failed)."""
        for index, item in enumerate(queued):
            if isinstance(item.command, ReserveCommand):
                self.num_pending_pages -= item.num_pages
                self.num_pending_requests -= 1
            if item.reply is not None and not item.reply.done() and replies is not None:
                item.reply.set_result(replies[index])

    def fail(self, queued: list[Queued], error: UnavailableError) -> None:
        """The rank lost its state: the step carrying ``queued`` and the rank's load are gone."""
        self.settle(queued, None)
        for item in queued:
            if item.reply is not None and not item.reply.done():
                item.reply.set_exception(error)
        self.load, self.is_busy = None, False


def place(ranks: Sequence[RankSlot], exclude: Sequence[RankSlot] = ()) -> RankSlot:
    """The serving rank with the most free pages, then the fewest requests (pending counted)."""
    candidates = [r for r in ranks if r.is_serving and r not in exclude]
    if not candidates:
        serving = sum(r.is_serving for r in ranks)
        raise UnavailableError(f"no decode rank serves ({serving} of {len(ranks)} serving)")

    def key(rank: RankSlot) -> tuple[int, int, int]:
        load = rank.load
        assert load is not None
        num_requests = (
            load.num_running_requests + load.num_reserved_requests + rank.num_pending_requests
        )
        return -(load.num_free_pages - rank.num_pending_pages), num_requests, rank.dp_rank

    return min(candidates, key=key)


def num_pages_of(load: RankLoad | None, command: ReserveCommand) -> int:
    """The pages the rank takes for ``command`` (the rank's scheduler takes as many)."""
    assert load is not None
    num_positions = min(len(command.prompt_ids) + command.params.max_new_tokens, load.max_model_len)
    return -(-num_positions // load.page_size)
