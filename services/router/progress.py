"""The per-hop progress bound: each call on a request's path answers within the stall limit.

A frozen worker (SIGSTOP, a stuck loop) keeps its gRPC connection open and answers
nothing, so only a bound on each hop ends the requests already on it before their
deadline. ``StallBound.call`` cancels the call (which cancels the RPC on the worker) and
raises ``UnavailableError`` naming the hop and the bound; the registry counts the stall.

A busy worker is not a frozen one: a prefill worker under load holds a request in its queue
for longer than the bound while it completes others. For the hops that complete a
request's part at once (tokenize, prefill) the bound runs from the later of the call's
start and the worker's last completed part of any request: the call stalls once the worker
itself has completed nothing for ``stall_timeout_s``, and the request deadline still bounds
the wait. A decode stream sends every step, so its bound is per message; a request that
waits on decode for a place in the running batch gets a message saying so while its rank
steps (decode's ``WAITING_LIST_S``), so only a decode that stopped stepping stalls it.

A stream's messages are bounded by ``StallBound.stream`` (``StreamBound.next``): the same
bound on each wait as ``call``, with one timer per stream that re-arms itself when it
finds the stream moved, not one per message (a timer per token and request was a fifth of
the router's busy time with 64 streams on CPU).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from services.common.errors import UnavailableError
from services.router.registry import WorkerRegistry
from services.router.workers import Hop, Worker

T = TypeVar("T")

_SILENCE = {
    Hop.TOKENIZE: "the tokenizer worker answered nothing",
    Hop.RESERVE: "the decode worker answered no Reserve",
    Hop.PREFILL: "the prefill worker sent no first token",
    Hop.GENERATE: "the decode worker sent nothing",
}


_COMPLETES = (
    Hop.TOKENIZE,
    Hop.PREFILL,
)  # decode completes with its stream's finish (generation.py)


class StallBound:
    def __init__(self, registry: WorkerRegistry, stall_timeout_s: float) -> None:
        assert stall_timeout_s > 0
        self._registry = registry
        self.stall_timeout_s = stall_timeout_s

    def stream(self, hop: Hop, worker: Worker, request_id: str) -> StreamBound:
        """The bound for each message of one stream on ``worker``; ``close`` it at the end."""
        assert hop not in _COMPLETES, "a stream's bound is per message"
        return StreamBound(self, hop, worker, request_id)

    async def call(self, hop: Hop, worker: Worker, request_id: str, awaitable: Awaitable[T]) -> T:
        """``await awaitable`` (one call on ``worker``), cancelled after the stall limit.

        Raises ``UnavailableError`` when the limit passes; anything the call raises
        passes through, and so does a cancellation from outside (the request's deadline).
        """
        loop = asyncio.get_running_loop()
        started_mono = time.monotonic()
        check: asyncio.TimerHandle | None = None
        try:
            async with asyncio.timeout(None) as bound:

                def expire_unless_moving() -> None:
                    nonlocal check
                    moved_mono = max(started_mono, worker.last_completed_mono)
                    left_s = moved_mono + self.stall_timeout_s - time.monotonic()
                    if hop in _COMPLETES and left_s > 0:  # it completed another request's part
                        check = loop.call_later(left_s, expire_unless_moving)
                    else:
                        bound.reschedule(loop.time())  # expire now: the call is cancelled

                check = loop.call_later(self.stall_timeout_s, expire_unless_moving)
                result = await awaitable
        except BaseException as exc:  # the call failed, stalled or was cancelled while in flight
            self.failed(exc, bound, hop, worker, request_id)
            raise
        finally:
            if check is not None:
                check.cancel()
        if hop in _COMPLETES:  # the worker's whole part of the request (health-check piggyback)
            self._registry.record_completed(worker)
        return result

    def failed(
        self, exc: BaseException, bound: asyncio.Timeout, hop: Hop, worker: Worker, request_id: str
    ) -> None:
        """Count a failed wait on ``worker``; ``UnavailableError`` when ``bound`` expired it."""
        self._registry.record_failure(worker)
        if not isinstance(exc, TimeoutError) or not bound.expired():
            return
        self._registry.record_stall(worker, hop)
        silence = f"{_SILENCE[hop]} for {self.stall_timeout_s:g} s (--stall-timeout-s)"
        if hop in _COMPLETES:
            silence += ", and completed no other request meanwhile"
        raise UnavailableError(f"request {request_id}: {silence}") from None


class StreamBound:
    """``StallBound.call`` for each message of one stream, with one timer per stream.

    ``next`` waits for the stream's next message; the wait fails as ``call``'s would once it
    passes the stall limit. The timer fires at most once per stall limit: it expires the wait
    in progress when that wait began a full limit ago, else it is set again for when it would.
    """

    def __init__(self, owner: StallBound, hop: Hop, worker: Worker, request_id: str) -> None:
        self._owner = owner
        self._hop = hop
        self._worker = worker
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._wait: asyncio.Timeout | None = None  # the wait in progress
        self._wait_started_mono = time.monotonic()
        self._timer = self._loop.call_later(owner.stall_timeout_s, self._check)

    async def next(self, messages: AsyncIterator[T]) -> T:
        """The next message (``StopAsyncIteration`` at the end), within the stall limit."""
        self._wait_started_mono = time.monotonic()
        try:
            async with asyncio.timeout(None) as wait:
                self._wait = wait
                return await anext(messages)
        except BaseException as exc:  # ended, failed, stalled or cancelled while waiting
            self._owner.failed(exc, wait, self._hop, self._worker, self._request_id)
            raise
        finally:
            self._wait = None

    def close(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        limit_s = self._owner.stall_timeout_s
        left_s = self._wait_started_mono + limit_s - time.monotonic()
        if self._wait is not None and left_s <= 0:
            self._wait.reschedule(self._loop.time())  # expire now: the wait is cancelled
        else:  # no wait, or a wait younger than the limit
            self._timer = self._loop.call_later(left_s if left_s > 0 else limit_s, self._check)
