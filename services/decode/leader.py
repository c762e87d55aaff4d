"""The decode leader: D data-parallel ranks behind one gRPC face; placement, routes, streams.

Everything here runs on the event loop's thread. Each rank is a free-running rank group of
one process (``RankHandle``; D ranks share no collective, so each is started and restarted
alone) that steps by itself: the leader posts commands to it as they come (``rank_views``)
and one reader task per rank hands out the reports the rank sends unasked (replies,
tokens, ends, load). Reservation expiry and quarantine release are the rank's own timers.
One more task ends running requests past their deadline: it wakes when a deadline is set
and at the earliest one, never on a fixed tick.

Request lifecycle in the leader (a ``Route``, ``routes.py``):
  reserve   -> placed on the serving rank with the most free pages, then the fewest
               requests (pages of Reserves not yet answered counted); a route names it.
               A rank that dies under the Reserve gives way to another serving rank once
  generate  -> the route gets its connection; the rank's tokens for it go there, and while
               it waits for a place in the rank's batch, its id (``WAITING_LIST_S``)
  end       -> finished (reported by the rank), aborted (Abort, the stream gone, its
               deadline), expired (reported), or failed (its rank died: UNAVAILABLE)
A rank's death ends every request routed to it; the others keep serving, and readiness
is SERVING while at least one rank serves. On SIGTERM ``drain`` refuses every Reserve
(UNAVAILABLE) while the live requests go on, up to its budget; ``stop`` fails the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from services.common.destinations import KvDestination
from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
    UnavailableError,
)
from services.common.ranks.free_supervisor import Reported
from services.decode import metrics
from services.decode.drain import Drain
from services.decode.messages import (
    AbortCommand,
    AbortReply,
    Command,
    RankLoad,
    RankReport,
    Reply,
    ReserveCommand,
    ReserveReply,
    StartCommand,
    StartReply,
)
from services.decode.rank_views import MakeRank, Queued, RankView, num_pages_of, place
from services.decode.routes import Route, Routes
from services.decode.scheduler import check_prompt_len
from services.decode.streams import WAITING_LIST_S, Connection, RequestEnded

logger = logging.getLogger(__name__)


class DecodeLeader:
    """The decode service's ranks and the requests on them; see the module docstring."""

    def __init__(
        self,
        num_ranks: int,
        make_rank: MakeRank,
        step_timeout_s: float,
        on_ready_change: Callable[[bool], None] = lambda is_ready: None,
    ) -> None:
        """``step_timeout_s``: how long ``start`` waits for each rank's first report."""
        assert num_ranks > 0 and step_timeout_s > 0
        self._loop = asyncio.get_running_loop()
        self._ranks = [
            RankView(r, make_rank(r, self._ready_callback(r), self._report_callback(r)))
            for r in range(num_ranks)
        ]
        self._step_timeout_s = step_timeout_s
        self._on_ready_change = on_ready_change
        self._routes = Routes()
        self._deadlines_changed = asyncio.Event()
        self._deadline_task: asyncio.Task | None = None
        self._is_stopping = False
        self._drain = Drain()
        self._was_ready = False

    @property
    def is_ready(self) -> bool:
        return not self._is_stopping and any(r.is_serving for r in self._ranks)

    def rank_loads(self) -> list[RankLoad | None]:
        """Each rank's load after its last step; None for a rank that does not serve."""
        return [r.load if r.is_serving else None for r in self._ranks]

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Form every rank (in parallel) and serve; ``RankStartError`` (all stopped) if one
        cannot."""
        try:
            await asyncio.gather(*(rank.handle.start() for rank in self._ranks))
        except BaseException:
            await asyncio.gather(*(r.handle.aclose() for r in self._ranks), return_exceptions=True)
            raise
        for rank in self._ranks:  # each rank's first report: its load, so placement can use it
            self._on_report(rank, [], await self._first_report(rank))
        for rank in self._ranks:
            rank.reader = asyncio.create_task(
                self._read_reports(rank), name=f"decode-rank-{rank.dp_rank}"
            )
            rank.reader.add_done_callback(self._task_done)
        self._deadline_task = asyncio.create_task(self._end_overdue(), name="decode-deadlines")
        self._deadline_task.add_done_callback(self._task_done)

    async def _first_report(self, rank: RankView) -> RankReport:
        try:
            reported = await asyncio.wait_for(rank.reports.get(), self._step_timeout_s)
            if reported.result is None:
                assert reported.error is not None
                raise reported.error
        except BaseException:
            await asyncio.gather(*(r.handle.aclose() for r in self._ranks), return_exceptions=True)
            raise
        assert isinstance(reported.result, RankReport)
        return reported.result

    async def drain(self, budget_s: float) -> None:
        """Refuse every Reserve from now on (UNAVAILABLE) and give the live requests (reserved
        and generating) ``budget_s`` to end; ``stop`` fails those left."""
        await self._drain.run(self._routes, budget_s)

    async def stop(self) -> None:
        """Fail every live request, stop the tasks, stop the ranks."""
        self._is_stopping = True
        tasks = [t for t in (self._deadline_task, *(r.reader for r in self._ranks)) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        reason = self._drain.stop_reason()
        for rank in self._ranks:
            self._fail_rank(rank, rank.take_all(), UnavailableError(reason))
        await asyncio.gather(*(r.handle.aclose() for r in self._ranks), return_exceptions=True)

    # --- requests -------------------------------------------------------------------------
    async def reserve(self, command: ReserveCommand) -> tuple[tuple[KvDestination, ...], int]:
        """Reserve on one rank; where prefill writes (each pool of a tensor-parallel rank, TP
        rank order), and the rank's index."""
        self._drain.check_admits()
        request_id = command.request_id
        tried: list[RankView] = []
        while True:
            if request_id in self._routes:
                raise InvalidRequestError(
                    f"request {request_id} is already live on decode", param="request_id"
                )
            rank = place(self._ranks, tried)
            assert rank.load is not None
            try:  # a prompt past the context never crosses the control channel (it can be huge)
                check_prompt_len(len(command.prompt_ids), rank.load.max_model_len)
            except InvalidRequestError:
                metrics.REQUESTS.labels("invalid").inc()
                raise
            route = self._routes.add(request_id, rank.dp_rank)
            try:
                reply = await self._call(rank, command, num_pages_of(rank.load, command))
            except UnavailableError:
                self._routes.drop(request_id, route)
                tried.append(rank)
                if len(tried) > 1 or not any(r.is_serving and r not in tried for r in self._ranks):
                    raise
                logger.warning(
                    "%s: decode rank %d failed under Reserve; once more on another rank",
                    request_id,
                    rank.dp_rank,
                )
                continue
            except asyncio.CancelledError:  # it may still reserve: nobody holds its KvRef, free it
                rank.send(AbortCommand(request_id, is_kv_written=True), self._dropping(route))
                raise
            assert isinstance(reply, ReserveReply)
            if reply.error is not None:
                self._routes.drop(request_id, route)
                error = reply.error.to_error()
                metrics.REQUESTS.labels(_refusal_outcome(error)).inc()
                raise error
            assert reply.destination is not None
            return (reply.destination, *reply.tp_destinations), rank.dp_rank

    def generate(
        self,
        conn: Connection,
        request_id: str,
        first_token_id: int,
        kv_written_proof: bytes,
        deadline_mono: float = float("inf"),
    ) -> None:
        """Start a reserved request on its rank; its tokens and end go to ``conn`` (errors too)."""
        route = self._routes.get(request_id)
        if route is None:
            lost = self._routes.pop_lost(request_id)
            error: StageServeError = NotFoundError(
                f"no reserved request {request_id} on decode (unknown, expired or aborted)"
            )
            if lost is not None:
                error = UnavailableError(f"{lost}; request {request_id} lost its reservation")
            conn.end(RequestEnded(request_id, error=error))
            return
        if route.conn is not None:
            error = InvalidRequestError(
                f"generate already started for {request_id}", param="request_id"
            )
            conn.end(RequestEnded(request_id, error=error))
            return
        route.conn, route.deadline_mono = conn, deadline_mono
        if deadline_mono != float("inf"):
            self._deadlines_changed.set()
        conn.request_ids.add(request_id)
        reply: asyncio.Future[Reply] = self._loop.create_future()
        reply.add_done_callback(lambda done: self._on_started(request_id, route, conn, done))
        self._ranks[route.rank].send(
            StartCommand(request_id, first_token_id, kv_written_proof), reply
        )

    async def abort(self, request_id: str, reason: str, *, is_kv_written: bool = False) -> bool:
        """Abort wherever it is (idempotent); its stream ends CANCELLED. False when it was not
        live."""
        route = self._routes.get(request_id)
        if route is None:
            return False
        text = f"request {request_id} aborted: {reason or 'by request'}"
        route.end(RequestEnded(request_id, error=AbortedError(text)))
        try:
            reply = await self._call(
                self._ranks[route.rank], AbortCommand(request_id, is_kv_written)
            )
        except UnavailableError:
            return True  # its rank died: the request is gone with it
        finally:
            self._routes.drop(request_id, route)
        assert isinstance(reply, AbortReply)
        if reply.is_found:
            metrics.REQUESTS.labels("aborted").inc()
            logger.info("aborted %s: %s", request_id, reason or "no reason given")
        return reply.is_found

    def close_connection(self, conn: Connection) -> None:
        """The stream is gone: abort its live requests (their pages freed at once)."""
        for request_id in list(conn.request_ids):
            route = self._routes.get(request_id)
            if route is not None and route.conn is conn:
                route.conn = None
                metrics.REQUESTS.labels("aborted").inc()
                self._ranks[route.rank].send(AbortCommand(request_id, True), self._dropping(route))
        conn.request_ids.clear()

    # --- commands -----------------------------------------------------------------------
    async def _call(self, rank: RankView, command: Command, num_pages: int = 0) -> Reply:
        reply: asyncio.Future[Reply] = self._loop.create_future()
        rank.send(command, reply, num_pages)
        return await reply

    def _dropping(self, route: Route) -> asyncio.Future[Reply]:
        """A reply future that drops ``route`` (if still its request's) once answered."""
        reply: asyncio.Future[Reply] = self._loop.create_future()

        def drop(done: asyncio.Future[Reply]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._routes.drop(done.result().request_id, route)

        reply.add_done_callback(drop)
        return reply

    def _on_started(
        self, request_id: str, route: Route, conn: Connection, done: asyncio.Future[Reply]
    ) -> None:
        error = (
            done.exception()
            if not done.cancelled()
            else UnavailableError("decode is shutting down")
        )
        if error is None:
            reply = done.result()
            assert isinstance(reply, StartReply)
            error = reply.error.to_error() if reply.error is not None else None
        if error is not None and route.conn is conn:  # the reservation stays as it was
            route.conn = None
            assert isinstance(error, StageServeError)
            conn.end(RequestEnded(request_id, error=error))

    # --- the reports ----------------------------------------------------------------------
    async def _read_reports(self, rank: RankView) -> None:
        while True:
            self._on_reported(rank, await rank.reports.get())

    def _on_reported(self, rank: RankView, reported: Reported) -> None:
        queued = rank.take_through(reported.through_seq)
        if reported.result is not None:
            assert isinstance(reported.result, RankReport)
            self._on_report(rank, queued, reported.result)
            return
        assert reported.error is not None
        if reported.is_down and not queued and rank.load is None:
            return  # posts lost with a rank already failed (or never serving): nothing more
        metrics.RANK_FAILURES.inc()  # its step failed (it goes on, empty) or it is down
        logger.error("decode rank %d failed: %s", rank.dp_rank, reported.error.message)
        error = UnavailableError(f"decode rank {rank.dp_rank} failed: {reported.error.message}")
        self._fail_rank(rank, queued, error)

    def _on_report(self, rank: RankView, queued: list[Queued], report: RankReport) -> None:
        assert len(report.replies) == len(queued), "one reply per command"
        rank.settle(queued, report.replies)
        rank.load = report.load
        self._routes.deliver(report)
        now = time.monotonic()  # a step that read rows: requests past them wait for a place
        if report.num_read_rows and now - rank.waiting_listed_mono >= WAITING_LIST_S:
            rank.waiting_listed_mono = now
            self._routes.list_waiting(rank.dp_rank, report.token_request_ids)
        metrics.record_report(rank.dp_rank, report)
        self._update_gauges()

    def _fail_rank(self, rank: RankView, queued: list[Queued], error: UnavailableError) -> None:
        """The rank lost its requests: end them with ``error``, fail its queued commands."""
        rank.fail(queued, error)
        lost = self._routes.fail_rank(rank.dp_rank, error)
        if lost:
            metrics.REQUESTS.labels("failed").inc(lost)
        self._update_gauges()

    async def _end_overdue(self) -> None:
        while True:
            self._deadlines_changed.clear()
            wait_s = self._routes.next_deadline_mono() - time.monotonic()
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    timeout_s = None if wait_s == float("inf") else wait_s
                    await asyncio.wait_for(self._deadlines_changed.wait(), timeout_s)
                continue
            for request_id, route in self._routes.overdue(time.monotonic()):
                error = DeadlineExceededError(f"request {request_id} passed its deadline on decode")
                route.end(RequestEnded(request_id, error=error))
                metrics.REQUESTS.labels("failed").inc()
                self._ranks[route.rank].send(AbortCommand(request_id, True), self._dropping(route))

    # --- readiness and gauges -------------------------------------------------------------
    def _ready_callback(self, dp_rank: int) -> Callable[[bool], None]:
        def on_change(is_ready: bool) -> None:  # the rank group's thread
            self._loop.call_soon_threadsafe(self._rank_ready_changed, dp_rank, is_ready)

        return on_change

    def _rank_ready_changed(self, dp_rank: int, is_ready: bool) -> None:
        logger.info("decode rank %d is %s", dp_rank, "ready" if is_ready else "not ready")
        self._update_gauges()  # a rank ready again serves from its first report on

    def _report_callback(self, dp_rank: int) -> Callable[[Reported], None]:
        def on_report(reported: Reported) -> None:  # the rank group's thread
            self._loop.call_soon_threadsafe(self._ranks[dp_rank].reports.put_nowait, reported)

        return on_report

    def _update_gauges(self) -> None:
        metrics.set_load_gauges([load for load in self.rank_loads() if load is not None])
        is_ready = self.is_ready
        if is_ready is not self._was_ready:
            self._was_ready = is_ready
            self._on_ready_change(is_ready)

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "%s failed: decode stops serving", task.get_name(), exc_info=task.exception()
            )
            self._is_stopping = True
            self._update_gauges()


def _refusal_outcome(error: StageServeError) -> str:
    if isinstance(error, CapacityError):
        return "rejected"
    return "expired" if isinstance(error, DeadlineExceededError) else "invalid"
