"""The leader's view of each DP rank: its handle, its last load, its commands, placement.

A command for a rank is queued, and posted to the rank (with the others queued in the same
turn of the event loop) right after; the rank's report names the posts it applied. A
Reserve's pages count against the rank from the moment it is queued until the report of
the step that applied it (which includes them), so a burst of Reserves spreads over the
ranks before any of them reports. Owned by the leader's event loop.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from services.common.errors import UnavailableError
from services.common.ranks.free_supervisor import Reported
from services.decode.messages import Command, RankCommands, RankLoad, Reply, ReserveCommand


class RankHandle(Protocol):
    """What the leader needs of one rank's group (a free-running
    ``services.common.ranks.group.RankGroup``)."""

    @property
    def is_ready(self) -> bool: ...

    async def start(self) -> None: ...

    def post(self, payload: msgspec.Struct) -> int: ...

    async def aclose(self) -> None: ...


MakeRank = Callable[
    [int, Callable[[bool], None], Callable[[Reported], None]], RankHandle
]  # (dp_rank, on_ready_change, on_report) -> handle; both callbacks from any thread


@dataclass
class Queued:
    command: Command
    reply: asyncio.Future[Reply] | None  # None: nobody waits for it
    num_pages: int = 0  # a Reserve's pages, counted against the rank until its report


@dataclass
class RankView:
    dp_rank: int
    handle: RankHandle
    load: RankLoad | None = None  # from its last report; None until its first after (re)forming
    queue: list[Queued] = field(default_factory=list)  # not posted yet
    posted: deque[tuple[int, list[Queued]]] = field(default_factory=deque)  # (seq, commands)
    num_pending_pages: int = 0  # pages of Reserves queued or posted, not yet reported
    num_pending_requests: int = 0
    waiting_listed_mono: float = 0.0  # when its waiting requests were last listed (streams.py)
    reports: asyncio.Queue[Reported] = field(default_factory=asyncio.Queue)
    reader: asyncio.Task | None = None

    @property
    def is_serving(self) -> bool:
        return self.handle.is_ready and self.load is not None

    def send(
        self, command: Command, reply: asyncio.Future[Reply] | None, num_pages: int = 0
    ) -> None:
        """Queue ``command`` for the rank (posted this turn); ``reply`` gets its answer."""
        if isinstance(command, ReserveCommand):
            self.num_pending_pages += num_pages
            self.num_pending_requests += 1
        self.queue.append(Queued(command, reply, num_pages))
        if len(self.queue) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Post the queued commands; a rank that does not serve fails them at once."""
        queued, self.queue = self.queue, []
        if not queued:
            return
        if not self.handle.is_ready:
            self.fail(queued, UnavailableError(f"decode rank {self.dp_rank} is down"))
            return
        seq = self.handle.post(RankCommands(tuple(q.command for q in queued)))
        self.posted.append((seq, queued))

    def take_through(self, seq: int) -> list[Queued]:
        """The commands of the posts up to ``seq``, in order (a report covered them)."""
        taken: list[Queued] = []
        while self.posted and self.posted[0][0] <= seq:
            taken += self.posted.popleft()[1]
        return taken

    def take_all(self) -> list[Queued]:
        """Every command posted or queued, in order (none will be answered)."""
        taken = self.take_through(sys.maxsize) + self.queue
        self.queue = []
        return taken

    def settle(self, queued: list[Queued], replies: Sequence[Reply] | None) -> None:
        """The step that applied ``queued`` ended: its replies in order, or None (it failed)."""
        for index, item in enumerate(queued):
            if isinstance(item.command, ReserveCommand):
                self.num_pending_pages -= item.num_pages
                self.num_pending_requests -= 1
            if item.reply is not None and not item.reply.done() and replies is not None:
                item.reply.set_result(replies[index])

    def fail(self, queued: list[Queued], error: UnavailableError) -> None:
        """The rank lost its state: the step that applied ``queued`` and the rank's load are
        gone."""
        self.settle(queued, None)
        for item in queued:
            if item.reply is not None and not item.reply.done():
                item.reply.set_exception(error)
        self.load = None


def place(ranks: Sequence[RankView], exclude: Sequence[RankView] = ()) -> RankView:
    """The serving rank with the most free pages, then the fewest requests (pending counted)."""
    candidates = [r for r in ranks if r.is_serving and r not in exclude]
    if not candidates:
        serving = sum(r.is_serving for r in ranks)
        raise UnavailableError(f"no decode rank serves ({serving} of {len(ranks)} serving)")

    def key(rank: RankView) -> tuple[int, int, int]:
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
