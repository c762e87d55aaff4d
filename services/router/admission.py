"""Admission: how many requests past tokenization run at once, and who waits for a slot.

A request's ticket moves through:
  arrive   -> a slot is free and nobody waits: it runs at once; else it joins the queue
              (arrival order), or gets ``OverloadedError`` (429) at once when
              ``max_queued`` requests already wait
  waiting  -> until a slot frees and the KV gate lets it through, or ``OverloadedError``
              once it has waited ``queue_timeout_s`` in all
  running  -> it holds a slot: Reserve on decode, prefill, decode
  refused  -> every decode worker answered RESOURCE_EXHAUSTED (no KV pages), or prefill
              did (its queue full): it gives its slot back and returns to its place in the
              queue (ahead of later arrivals, past the queue bound), and the KV gate narrows
  closed   -> the slot (or the place in the queue) is given back, in ``finally``

The KV gate keeps requests that wait for decode's pages in order and the Reserve calls
few: after a refusal nobody is let through until a running request ends (its pages are
freed) or a backoff passes (pages also free elsewhere: quarantine, other routers). Then
one request at a time tries; each success doubles how many may try at once, each refusal
starts over at one with a doubled backoff; the gate opens fully when the window reaches
``max_running`` or nobody waits or tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import logging
from collections.abc import Iterator

import msgspec

from services.common.errors import CapacityError, OverloadedError
from services.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # Retry-After of every 429 the router sends
KV_BACKOFF_S = 0.05  # first pause after a refusal; doubles per refusal in a row
KV_BACKOFF_MAX_S = 1.0


class TicketState(enum.Enum):
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    CLOSED = "closed"


class RejectReason(enum.Enum):
    QUEUE_FULL = "queue_full"  # the queue held max_queued requests when it arrived
    QUEUE_TIMEOUT = "queue_timeout"  # it waited queue_timeout_s for a slot
    KV_CAPACITY = "kv_capacity"  # it waited queue_timeout_s while decode had no KV pages
    PREFILL_CAPACITY = "prefill_capacity"  # ... while prefill's queue was full


class AdmissionSnapshot(msgspec.Struct, frozen=True):
    """Admission's state now (``/health`` detail)."""

    num_running: int
    num_queued: int
    max_running: int
    max_queued: int
    is_kv_limited: bool  # a decode refused pages and the gate has not opened fully since


class Ticket:
    """One request's place in admission; only ``AdmissionManager`` changes it."""

    def __init__(self, request_id: str, seq: int, wait_deadline: float) -> None:
        self.request_id = request_id
        self.seq = seq  # arrival order: the queue's key
        self.wait_deadline = wait_deadline  # event-loop clock
        self.state = TicketState.NEW
        self.refusal: CapacityError | None = None  # why it waits for capacity, if it does
        self.refusal_reason = RejectReason.KV_CAPACITY  # whose capacity: decode's or prefill's
        self.waited_s = 0.0
        self.is_wait_observed = False
        self.granted: asyncio.Future[None] | None = None
        self.waiting_since = 0.0

    def __lt__(self, other: Ticket) -> bool:
        return self.seq < other.seq


class AdmissionManager:
    """Owns the request slots, the FIFO queue and the KV gate of one router (one event loop)."""

    def __init__(
        self, max_running: int, max_queued: int, queue_timeout_s: float, metrics: RouterMetrics
    ) -> None:
        assert max_running >= 1 and max_queued >= 0 and queue_timeout_s >= 0
        self.max_running = max_running
        self.max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._metrics = metrics
        self._seq = itertools.count()
        self._heap: list[Ticket] = []  # WAITING tickets, and CLOSED ones not popped yet
        self._num_waiting = 0
        self._num_running = 0
        self._is_kv_limited = False
        self._window = (
            max_running  # while kv-limited: granted tickets awaiting their Reserve result
        )
        self._trying: set[Ticket] = set()
        self._num_refusals = 0  # in a row, for the backoff
        self._last_refusal: CapacityError | None = None
        self._last_refusal_reason = RejectReason.KV_CAPACITY
        self._backoff: asyncio.TimerHandle | None = None

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            self._num_running,
            self._num_waiting,
            self.max_running,
            self.max_queued,
            self._is_kv_limited,
        )

    @contextlib.contextmanager
    def ticket(self, request_id: str) -> Iterator[Ticket]:
        """A ticket for ``request_id``; leaving the block gives back its slot or queue place."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(request_id, next(self._seq), loop.time() + self._queue_timeout_s)
        try:
            yield ticket
        finally:
            self._close(ticket)

    async def wait_turn(self, ticket: Ticket) -> None:
        """Return once ``ticket`` holds a slot (at once if it does).

        Raises ``OverloadedError`` when the queue is full on arrival or the wait limit passes.
        """
        if ticket.state is TicketState.RUNNING:
            return
        assert ticket.state in (TicketState.NEW, TicketState.WAITING), ticket.state
        if ticket.state is TicketState.NEW:
            if self._num_waiting >= self.max_queued and not self._can_grant():
                self._reject(ticket, RejectReason.QUEUE_FULL)
            self._enqueue(ticket)
            self._dispatch()
        if ticket.state is TicketState.WAITING:
            await self._wait_granted(ticket)

    def refused(
        self,
        ticket: Ticket,
        error: CapacityError,
        reason: RejectReason = RejectReason.KV_CAPACITY,
    ) -> None:
        """Every decode worker refused ``ticket`` KV pages (or prefill refused it a place in
        its queue, ``PREFILL_CAPACITY``): back to its place in the queue."""
        assert ticket.state is TicketState.RUNNING
        assert reason in (RejectReason.KV_CAPACITY, RejectReason.PREFILL_CAPACITY)
        ticket.refusal = self._last_refusal = error
        ticket.refusal_reason = self._last_refusal_reason = reason
        self._trying.discard(ticket)
        self._num_running -= 1
        self._enqueue(ticket)
        self._is_kv_limited, self._window = True, 1
        delay_s = min(KV_BACKOFF_MAX_S, KV_BACKOFF_S * 2**self._num_refusals)
        self._num_refusals += 1
        self._cancel_backoff()
        self._backoff = asyncio.get_running_loop().call_later(delay_s, self._backoff_passed)
        self._publish()

    def reserved(self, ticket: Ticket) -> None:
        """``ticket``'s Reserve succeeded: it stops waiting for good; the gate widens."""
        self._observe_wait(ticket)
        if ticket in self._trying:
            self._trying.discard(ticket)
            self._num_refusals = 0
            self._window = min(2 * self._window, self.max_running)
            if self._window >= self.max_running:
                self._is_kv_limited = False
            self._dispatch()

    # ------------------------------------------------------------ internals

    def can_admit_now(self) -> bool:
        """True when a request arriving now would take a slot at once (none waiting ahead of
        it, a slot free, no KV backoff)."""
        return self._num_waiting == 0 and self._can_grant()

    def _can_grant(self) -> bool:
        if self._num_running >= self.max_running:
            return False
        if not self._is_kv_limited:
            return True
        return self._backoff is None and len(self._trying) < self._window

    def _enqueue(self, ticket: Ticket) -> None:
        ticket.state = TicketState.WAITING
        ticket.waiting_since = asyncio.get_running_loop().time()
        heapq.heappush(self._heap, ticket)
        self._num_waiting += 1

    def _dispatch(self) -> None:
        while self._num_waiting and self._can_grant():
            ticket = heapq.heappop(self._heap)
            if ticket.state is not TicketState.WAITING:
                continue  # closed while queued
            self._num_waiting -= 1
            ticket.waited_s += asyncio.get_running_loop().time() - ticket.waiting_since
            ticket.state = TicketState.RUNNING
            self._num_running += 1
            if self._is_kv_limited:
                self._trying.add(ticket)
            if ticket.granted is not None and not ticket.granted.done():
                ticket.granted.set_result(None)
        if not self._num_waiting:
            self._heap.clear()
            if not self._trying:  # nobody waits or tries: the next refusal narrows the gate again
                self._is_kv_limited = False
        self._publish()

    async def _wait_granted(self, ticket: Ticket) -> None:
        loop = asyncio.get_running_loop()
        remaining_s = ticket.wait_deadline - loop.time()
        ticket.granted = loop.create_future()
        try:
            async with asyncio.timeout(max(0.0, remaining_s)):
                await ticket.granted
        except TimeoutError:
            if ticket.state is not TicketState.RUNNING:  # granted just as the limit passed: run
                if ticket.refusal is None and self._is_kv_limited:  # held back by the KV gate
                    ticket.refusal = self._last_refusal
                    ticket.refusal_reason = self._last_refusal_reason
                self._unqueue(ticket)
                is_refused = ticket.refusal is not None
                self._reject(
                    ticket, ticket.refusal_reason if is_refused else RejectReason.QUEUE_TIMEOUT
                )
        finally:
            ticket.granted = None

    def _unqueue(self, ticket: Ticket) -> None:
        assert ticket.state is TicketState.WAITING
        ticket.state = TicketState.NEW
        ticket.waited_s += asyncio.get_running_loop().time() - ticket.waiting_since
        self._num_waiting -= 1  # its heap entry is skipped when popped
        self._dispatch()

    def _reject(self, ticket: Ticket, reason: RejectReason) -> None:
        ticket.state = TicketState.CLOSED
        self._observe_wait(ticket)
        self._metrics.admission_rejected.labels(reason.value).inc()
        raise OverloadedError(self._reject_message(ticket, reason), retry_after_s=RETRY_AFTER_S)

    def _reject_message(self, ticket: Ticket, reason: RejectReason) -> str:
        load = f"{self._num_running} running, {self._num_waiting} queued"
        if reason is RejectReason.QUEUE_FULL:
            return f"the router is at capacity ({load}; queue limit {self.max_queued}); retry later"
        waited = f"request {ticket.request_id} waited {ticket.waited_s:.1f} s (--queue-timeout-s)"
        if reason is RejectReason.KV_CAPACITY:
            return f"{waited} for KV pages on decode: {ticket.refusal}"
        if reason is RejectReason.PREFILL_CAPACITY:
            return f"{waited} for room in prefill's queue: {ticket.refusal}"
        return f"{waited} for one of {self.max_running} request slots ({load})"

    def _close(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.WAITING:
            self._unqueue(ticket)
        elif ticket.state is TicketState.RUNNING:
            self._num_running -= 1
            self._trying.discard(ticket)
            self._cancel_backoff()  # a request ended: pages may be free now
            self._dispatch()
        self._observe_wait(ticket)
        ticket.state = TicketState.CLOSED

    def _backoff_passed(self) -> None:
        self._backoff = None
        self._dispatch()

    def _cancel_backoff(self) -> None:
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None

    def _observe_wait(self, ticket: Ticket) -> None:
        if not ticket.is_wait_observed:
            ticket.is_wait_observed = True
            self._metrics.admission_wait.observe(ticket.waited_s)

    def _publish(self) -> None:
        self._metrics.set_admission(self._num_running, self._num_waiting)
