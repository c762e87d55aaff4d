"""Where the decode leader's live requests are: each one's route, and reservations lost.

A route names a request's rank from its Reserve on, and once it generates, its connection
(where its tokens and end go) and deadline. A rank's death ends every request routed to
it; a reserved one is remembered as lost (newest ``MAX_LOST`` kept) so that its generate
fails UNAVAILABLE rather than NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import UnavailableError
from services.decode.messages import RankReport
from services.decode.streams import Connection, RequestEnded

MAX_LOST = 4096  # reservations lost to a dead rank remembered for their generate, newest kept


@dataclass
class Route:
    """Where a live request is: its rank, and once generating, its connection and deadline."""

    rank: int
    conn: Connection | None = None  # set by generate
    deadline_mono: float = float("inf")  # past it a running request ends DEADLINE_EXCEEDED

    def end(self, ended: RequestEnded) -> None:
        """End the request's stream (once; a route without a connection has none)."""
        if self.conn is not None:
            self.conn.end(ended)
            self.conn = None


class Routes:
    """The live requests' routes by request id, and the reservations a rank's death took."""

    def __init__(self) -> None:
        self._live: dict[str, Route] = {}
        # Reservations a rank's death took, until their generate comes (UNAVAILABLE, not NOT_FOUND)
        self._lost: OrderedDict[str, str] = OrderedDict()
        self._emptied = asyncio.Event()  # set when the last live request leaves

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def get(self, request_id: str) -> Route | None:
        return self._live.get(request_id)

    def add(self, request_id: str, rank: int) -> Route:
        """A new route for ``request_id`` on ``rank`` (no longer lost, if it was)."""
        self._lost.pop(request_id, None)
        route = self._live[request_id] = Route(rank)
        return route

    def drop(self, request_id: str, route: Route) -> None:
        """Forget ``route`` if it is still ``request_id``'s."""
        if self._live.get(request_id) is route:
            del self._live[request_id]
            self._check_empty()

    def pop_lost(self, request_id: str) -> str | None:
        """Why ``request_id``'s reservation was lost (forgotten now); None when it was not."""
        return self._lost.pop(request_id, None)

    def deliver(self, report: RankReport) -> None:
        """Hand a rank's report out: tokens to their streams, ends; forget expired requests."""
        logprobs = dict(zip(report.logprob_indices, report.logprobs, strict=True))
        tokens = zip(report.token_request_ids, report.token_ids, strict=True)
        for i, (request_id, token_id) in enumerate(tokens):
            route = self._live.get(request_id)
            if route is not None and route.conn is not None:
                route.conn.add_token(request_id, token_id, logprobs.get(i))
        for done in report.finished:
            route = self._live.pop(done.request_id, None)
            if route is not None:
                route.end(RequestEnded(done.request_id, done.reason, done.usage))
        for request_id in report.expired:
            self._live.pop(request_id, None)
        self._check_empty()

    def list_waiting(self, dp_rank: int, token_request_ids: Sequence[str]) -> None:
        """List on its connection each generating request on ``dp_rank`` that got no token in
        the rank's report (``token_request_ids``): it waits for a place in the batch."""
        stepped = set(token_request_ids)
        for request_id, route in self._live.items():
            if route.rank == dp_rank and route.conn is not None and request_id not in stepped:
                route.conn.add_waiting(request_id)

    def fail_rank(self, dp_rank: int, error: UnavailableError) -> int:
        """End every request on ``dp_rank`` with ``error`` (reserved ones become lost); how many."""
        lost = [(i, r) for i, r in self._live.items() if r.rank == dp_rank]
        for request_id, route in lost:
            del self._live[request_id]
            if route.conn is None:  # reserved: its generate may still come
                self._lost[request_id] = error.message
                while len(self._lost) > MAX_LOST:
                    self._lost.popitem(last=False)
            route.end(
                RequestEnded(
                    request_id,
                    error=UnavailableError(f"{error.message}; request {request_id} did not finish"),
                )
            )
        self._check_empty()
        return len(lost)

    async def wait_empty(self) -> None:
        """Return once no request is live (at once when none is)."""
        while self._live:
            self._emptied.clear()
            await self._emptied.wait()

    def _check_empty(self) -> None:
        if not self._live:
            self._emptied.set()

    def next_deadline_mono(self) -> float:
        """The earliest deadline of a generating request (inf: none)."""
        return min(
            (r.deadline_mono for r in self._live.values() if r.conn is not None), default=math.inf
        )

    def overdue(self, now: float) -> list[tuple[str, Route]]:
        """The generating requests whose deadline is at or before ``now``."""
        return [
            (i, r) for i, r in self._live.items() if r.conn is not None and r.deadline_mono <= now
        ]
