"""Placement: KV pages on a decode worker, then the prompt's KV written by a prefill worker.

  reserve  -> Reserve on a ready decode worker (policy order). One answering UNAVAILABLE
              (or stalling) gives way to another ready one, once. One answering
              RESOURCE_EXHAUSTED gives way to each other ready one; when all refuse, the
              request gives its admission slot back and waits in the queue for pages
  prefill  -> Prefill on a ready prefill worker until it returns the first token. One
              answering UNAVAILABLE or stalling, while another ready prefill worker
              exists, gives way to it once: the reservation is aborted first with
              ``is_kv_written=False`` (decode quarantines its pages against a late write
              from the abandoned call) and a fresh one is reserved for the second attempt.
              One answering RESOURCE_EXHAUSTED (its queue full) refuses the request as a
              full decode does: the reservation is aborted the same way, the request gives
              its admission slot back and waits in the queue, then reserves afresh
  end      -> the reservation's lease is released; unless decode finished the request
              itself, decode's Abort is sent in the background (idempotent) with
              ``is_kv_written`` true exactly when prefill returned successfully
Any other error (bad input, deadline, cancellation) ends the request where it happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from services.common.errors import CapacityError, StageServeError, UnavailableError
from services.common.types import SamplingParams, TokenizedPrompt
from services.router.admission import AdmissionManager, RejectReason, Ticket
from services.router.metrics import RouterMetrics
from services.router.peers import DecodePeer, PrefillPeer
from services.router.progress import StallBound
from services.router.registry import WorkerRegistry
from services.router.workers import Hop, Worker, WorkerKind

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task]


@dataclass(frozen=True)
class KvJob:
    """What placement needs of a request."""

    request_id: str
    prompt: TokenizedPrompt
    params: SamplingParams  # max_new_tokens already fitted to the context
    deadline_unix_s: float  # absolute, time.time() clock


@dataclass(eq=False)
class Reservation:
    """KV pages one decode worker (leased while this lives) holds for a request."""

    request_id: str
    worker: Worker
    kv_ref: Any  # KvRefInfo: where prefill writes
    is_kv_written: bool = False  # prefill returned successfully: its write has landed
    is_ended: bool = False


class Placer:
    def __init__(
        self,
        registry: WorkerRegistry,
        admission: AdmissionManager,
        bound: StallBound,
        metrics: RouterMetrics,
        spawn: Spawn,
    ) -> None:
        self._registry = registry
        self._admission = admission
        self._bound = bound
        self._metrics = metrics
        self._spawn = spawn

    async def place(self, job: KvJob, ticket: Ticket) -> tuple[Reservation, Any]:
        """A reservation holding the prompt's KV and prefill's result (PrefillResult).

        The caller owns the reservation and ends it (``end``); on an error nothing is left.
        """
        failed: list[Worker] = []  # prefill workers that were unavailable or stalled
        while True:
            reservation = await self.reserve(job, ticket)
            prefill: Worker | None = None
            refusal: CapacityError | None = None
            try:
                prefill = self._registry.acquire(WorkerKind.PREFILL, failed, job.prompt)
                client: PrefillPeer = prefill.client
                call = client.prefill(
                    job.request_id, job.prompt, job.params, reservation.kv_ref, job.deadline_unix_s
                )
                result = await self._bound.call(Hop.PREFILL, prefill, job.request_id, call)
                reservation.is_kv_written = True  # prefill answers only after the whole KV landed
                return reservation, result
            except CapacityError as exc:  # its queue is full: wait in admission for room
                assert prefill is not None
                self._metrics.prefill_refusals.labels(prefill.address).inc()
                refusal = error = exc
            except UnavailableError as exc:
                has_other = prefill is not None and self._registry.has_ready(
                    WorkerKind.PREFILL, [prefill]
                )
                if failed or not has_other:
                    self.end(reservation)
                    raise
                assert prefill is not None
                failed.append(prefill)
                error = exc
            except BaseException:
                self.end(reservation)
                raise
            finally:
                if prefill is not None:
                    self._registry.release(prefill)
            if not await self._abort_for_retry(reservation):
                raise error
            if refusal is not None:
                self._admission.refused(ticket, refusal, RejectReason.PREFILL_CAPACITY)
                continue
            self._metrics.worker_retries.labels(WorkerKind.PREFILL.value).inc()
            logger.warning(
                "%s: prefill on %s failed (%s); once more on another prefill worker",
                job.request_id,
                failed[-1].address,
                error,
            )

    async def reserve(self, job: KvJob, ticket: Ticket) -> Reservation:
        """Reserve pages on some decode worker, waiting in the admission queue while all are
        full."""
        while True:
            await self._admission.wait_turn(ticket)
            try:
                reservation = await self._reserve_once(job)
            except CapacityError as exc:
                self._admission.refused(ticket, exc)
                continue
            self._admission.reserved(ticket)
            return reservation

    async def _reserve_once(self, job: KvJob) -> Reservation:
        """Try the ready decode workers; ``CapacityError`` when every one tried is out of pages."""
        tried: list[Worker] = []
        refusal: CapacityError | None = None
        num_unavailable = 0
        while True:
            if refusal is not None and not self._registry.has_ready(WorkerKind.DECODE, tried):
                raise refusal
            worker = self._registry.acquire(WorkerKind.DECODE, exclude=tried)
            tried.append(worker)
            try:
                decode: DecodePeer = worker.client
                call = decode.reserve(
                    job.request_id,
                    job.prompt.token_ids,
                    job.prompt.mrope_position_delta,
                    job.params,
                    job.deadline_unix_s,
                )
                kv_ref = await self._bound.call(Hop.RESERVE, worker, job.request_id, call)
                return Reservation(job.request_id, worker, kv_ref)
            except CapacityError as exc:
                self._registry.release(worker)
                self._metrics.kv_refusals.labels(worker.address).inc()
                refusal = exc
            except UnavailableError:
                self.end(Reservation(job.request_id, worker, None))  # it may have reserved anyway
                num_unavailable += 1
                if num_unavailable > 1 or not self._registry.has_ready(WorkerKind.DECODE, tried):
                    if refusal is not None:
                        raise refusal from None
                    raise
                self._metrics.worker_retries.labels(WorkerKind.DECODE.value).inc()
                logger.warning(
                    "%s: Reserve on %s failed; once more on another decode worker",
                    job.request_id,
                    worker.address,
                )
            except BaseException:  # a reservation answered after a cancellation must be aborted too
                self.end(Reservation(job.request_id, worker, None))
                raise

    def end(self, reservation: Reservation, *, is_decode_done: bool = False) -> None:
        """Release the decode lease; abort on decode in the background unless decode finished it."""
        if reservation.is_ended:
            return
        reservation.is_ended = True
        self._registry.release(reservation.worker)
        if not is_decode_done:
            abort = abort_on(reservation.worker, reservation.request_id, reservation.is_kv_written)
            self._spawn(abort, f"abort-{reservation.request_id}")

    async def _abort_for_retry(self, reservation: Reservation) -> bool:
        """Abort ``reservation`` (KV not written) and wait for it, so the id can reserve again."""
        assert not reservation.is_ended
        reservation.is_ended = True
        self._registry.release(reservation.worker)
        request_id = reservation.request_id
        task = self._spawn(abort_on(reservation.worker, request_id, False), f"abort-{request_id}")
        return await asyncio.shield(task)  # cancelled here, the abort still runs to its end


async def abort_on(worker: Worker, request_id: str, is_kv_written: bool) -> bool:
    """Abort ``request_id`` on decode ``worker``; False when decode did not answer."""
    decode: DecodePeer = worker.client
    try:
        async with asyncio.timeout(ABORT_TIMEOUT_S):
            await decode.abort(
                request_id, "the router ended the request", is_kv_written=is_kv_written
            )
    except (StageServeError, TimeoutError) as exc:  # a dead decode frees the pages by dying
        logger.info("abort of %s on decode %s failed: %s", request_id, worker.address, exc)
        return False
    return True
