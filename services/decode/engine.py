"""The decode leader's engine: scheduler under one lock, the step loop on its own thread.

gRPC handlers (event-loop thread) call ``reserve`` / ``generate`` / ``abort`` / ``stats``;
each holds the lock only for bookkeeping. The loop thread takes a plan under the lock,
runs it on the rank worker without the lock, applies the result under the lock and
pushes each request's events to its stream. Idle, it waits on the condition (woken by
``generate``, or every ``sweep_interval_s`` to expire overdue reservations and return
quarantined pages to the free list).
If the loop thread dies, every live request fails and the engine refuses new ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from services.common.progress import ProgressWatchdog
from services.decode import metrics
from services.decode.scheduler import DecodePlan, DecodeRequest, DecodeScheduler, ReqStatus, TokenEvent
from services.decode.stream import DecodeEvent, EndKind, RequestEnded
from services.decode.worker import DecodeWorker
from services.transfer.base import BaseKVReceiver, Clock, KvDestination

logger = logging.getLogger(__name__)

EventSink = Callable[[DecodeEvent], None]  # thread-safe


@dataclass(frozen=True)
class EngineStats:
    page_size: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_quarantined_pages: int  # pages of failed reservations a late KV write may still reach
    num_running_requests: int
    num_reserved_requests: int


class DecodeEngine:
    def __init__(
        self,
        scheduler: DecodeScheduler,
        worker: DecodeWorker,
        receiver: BaseKVReceiver,
        *,
        watchdog_s: float = 30.0,
        sweep_interval_s: float = 0.5,
        clock: Clock = time.monotonic,  # the receiver's session clock
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.receiver = receiver
        self.sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())  # re-entered by session release callbacks
        self._sinks: dict[str, EventSink] = {}
        self._last_token_s: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._next_sweep_s = 0.0
        self.progress = ProgressWatchdog(
            "decode", watchdog_s, lambda: self.scheduler.has_work, is_alive=self._is_running, clock=clock,
            stalled_gauge=metrics.STALLED,
        )

    def start(self) -> None:
        assert self._thread is None, "start the engine once"
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; every live request fails (pages freed)."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread is None:
            self._fail_all("decode is shutting down")

    def is_healthy(self) -> bool:
        """Loop alive, and (when it has work) it made progress within ``watchdog_s``.

        Lock-free on purpose: a loop stuck while holding the lock must not stall the caller.
        """
        return self.progress.is_healthy()

    def reserve(self, request: DecodeRequest, deadline_s: float) -> KvDestination:
        """Validate, take the pages, open the transfer session; where prefill writes the prompt's KV.

        ``deadline_s`` is on the engine clock; the pages are freed if Generate has not
        started by then.
        """
        with self._cond:
            self._check_running()
            try:
                self._validate(request)
                if deadline_s <= self._clock():
                    metrics.REQUESTS.labels("expired").inc()
                    raise DeadlineExceededError(f"{request.request_id}: deadline passed before Reserve")
                pages = self.scheduler.add(request)
            except CapacityError:
                metrics.REQUESTS.labels("rejected").inc()
                raise
            except InvalidRequestError:
                metrics.REQUESTS.labels("invalid").inc()
                raise
            is_open = False
            try:
                prompt_pages = pages[: self.scheduler.kv.num_pages_for(len(request.prompt_ids))]
                session = self.receiver.open_session(
                    request.request_id, prompt_pages, deadline_s, self._release_reserved
                )
                is_open = True
            finally:
                if not is_open:
                    self.scheduler.abort(request.request_id)
            self._update_gauges()
            assert session.destination is not None
            return session.destination

    def generate(
        self, request_id: str, first_token_id: int, kv_written_proof: bytes, sink: EventSink
    ) -> None:
        """Mark the KV written and admit the request; its events go to ``sink`` from now on.

        ``kv_written_proof`` must be what prefill returned for the reservation; without it
        (``InvalidRequestError``) the reservation stays as it was.
        """
        with self._cond:
            self._check_running()
            if not 0 <= first_token_id < self.worker.vocab_size:
                raise InvalidRequestError(
                    f"first_token_id must be in [0, {self.worker.vocab_size})", param="first_token_id"
                )
            status = self.scheduler.status(request_id)
            if status is None:
                raise NotFoundError(f"no reserved request {request_id} on decode (unknown, expired or aborted)")
            if status is not ReqStatus.RESERVED:
                raise InvalidRequestError(f"Generate already started for {request_id}", param="request_id")
            self.scheduler.check_kv_written(request_id, kv_written_proof)
            self.receiver.sessions.complete(request_id)
            event = self.scheduler.start(request_id, first_token_id)
            if event is not None:  # the first token already finished it
                self._count_finished(event)
                sink(event)
            else:
                self._sinks[request_id] = sink
                self._last_token_s[request_id] = self._clock()
                self._cond.notify_all()
            self._update_gauges()

    def abort(self, request_id: str, reason: str, *, is_kv_written: bool = False) -> bool:
        """Abort wherever the request is; its stream ends ABORTED. False when it was not live.

        A request still waiting for its KV has its pages quarantined (prefill may still be
        writing them) unless ``is_kv_written``: the caller knows prefill finished writing.
        """
        with self._cond:
            is_found = is_kv_written and self.scheduler.abort(request_id)  # no late write: freed at once
            is_found = self.receiver.sessions.abort(request_id) or is_found  # RESERVED: quarantined
            is_found = self.scheduler.abort(request_id) or is_found  # KV ready: freed at once
            if is_found:
                metrics.REQUESTS.labels("aborted").inc()
                logger.info("aborted %s: %s", request_id, reason or "no reason given")
            self._end_stream(request_id, EndKind.ABORTED, f"request {request_id} aborted: {reason or 'by request'}")
            self._update_gauges()
            return is_found

    def stats(self) -> EngineStats:
        with self._cond:
            kv = self.scheduler.kv
            return EngineStats(
                page_size=kv.page_size,
                num_total_pages=kv.num_total_pages,
                num_free_pages=kv.num_free_pages,
                num_used_pages=kv.num_used_pages,
                num_quarantined_pages=kv.num_quarantined_pages,
                num_running_requests=self.scheduler.num_running,
                num_reserved_requests=self.scheduler.num_reserved,
            )

    def _validate(self, request: DecodeRequest) -> None:
        request.params.validate()
        request.params.check_vocab(self.worker.vocab_size)
        prompt_len, max_len = len(request.prompt_ids), self.scheduler.max_model_len
        if not request.request_id:
            raise InvalidRequestError("request_id is empty", param="request_id")
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt_token_ids")
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens; the context limit is {max_len}", param="prompt_token_ids"
            )
        if max(request.prompt_ids) >= self.worker.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be < {self.worker.vocab_size}", param="prompt_token_ids"
            )
        kv = self.scheduler.kv
        num_pages = kv.num_pages_for(self.scheduler.num_positions(prompt_len, request.params))
        if num_pages > kv.num_total_pages:
            raise InvalidRequestError(
                f"prompt + max_new_tokens need {num_pages} KV pages, more than this decode's "
                f"{kv.num_total_pages}", param="max_new_tokens",
            )

    def _is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._is_stopping

    def _check_running(self) -> None:
        if not self._is_running():
            raise UnavailableError("the decode engine is not running")

    def _release_reserved(self, request_id: str, page_ids: tuple[int, ...]) -> None:
        """Release callback of a transfer session that failed (aborted, expired) before Generate.

        An abandoned write may still land in the pages, so they go to quarantine.
        """
        del page_ids  # the scheduler quarantines every page of the request
        with self._cond:
            if self.scheduler.status(request_id) is ReqStatus.RESERVED:
                self.scheduler.abort(request_id, quarantine=True)
            self._update_gauges()

    def _run(self) -> None:
        try:
            while (plan := self._next_plan()) is not None:
                self._step(plan)
        finally:
            self._fail_all("the decode engine stopped")

    def _next_plan(self) -> DecodePlan | None:
        with self._cond:
            while not self._is_stopping:
                self._tick()
                if self.scheduler.has_work:
                    return self.scheduler.schedule()
                self._cond.wait(self.sweep_interval_s)
            return None

    def _tick(self) -> None:
        self.progress.tick()
        now = self._clock()
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + self.sweep_interval_s
        expired = self.receiver.sessions.expire()  # release callbacks quarantine the pages
        if expired:
            metrics.REQUESTS.labels("expired").inc(len(expired))
            logger.info("reservations expired before Generate: %s", ", ".join(expired))
        if self.scheduler.kv.release_quarantined() or expired:
            self._update_gauges()

    def _step(self, plan: DecodePlan) -> None:
        start_s = self._clock()
        result = self.worker.execute(plan)
        with self._cond:
            events = self.scheduler.update_from_output(plan, result.token_ids)
            self.progress.tick()
            now = self._clock()
            for event in events:
                self._deliver(event, now)
            self._update_gauges()
        if plan.items:
            metrics.STEP_TIME.observe(now - start_s)
            metrics.BATCH_SIZE.observe(len(plan.items))
            metrics.TOKENS_GENERATED.inc(len(result.token_ids))

    def _deliver(self, event: TokenEvent, now: float) -> None:
        request_id = event.request_id
        last_s = self._last_token_s.get(request_id)
        if last_s is not None:
            metrics.INTER_TOKEN_LATENCY.observe(now - last_s)
            self._last_token_s[request_id] = now
        sink = self._sinks.get(request_id)
        if event.finish_reason is not None:
            self._count_finished(event)
            self._sinks.pop(request_id, None)
            self._last_token_s.pop(request_id, None)
        if sink is not None:
            sink(event)

    @staticmethod
    def _count_finished(event: TokenEvent) -> None:
        assert event.finish_reason is not None
        metrics.REQUESTS.labels(event.finish_reason.value).inc()

    def _end_stream(self, request_id: str, kind: EndKind, message: str) -> None:
        self._last_token_s.pop(request_id, None)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(RequestEnded(request_id, kind, message))

    def _fail_all(self, message: str) -> None:
        """No step runs any more: end every live request (its pages freed) and refuse new ones."""
        with self._cond:
            self._is_stopping = True
            request_ids = self.scheduler.abort_all()
            self.receiver.sessions.abort_all()
            if request_ids:
                metrics.REQUESTS.labels("failed").inc(len(request_ids))
                logger.warning("%s: failing %d live requests", message, len(request_ids))
            for request_id in request_ids:
                self._end_stream(request_id, EndKind.FAILED, f"{message}; request {request_id} did not finish")
            self._update_gauges()

    def _update_gauges(self) -> None:
        kv = self.scheduler.kv
        metrics.RUNNING_REQUESTS.set(self.scheduler.num_running)
        metrics.RESERVED_REQUESTS.set(self.scheduler.num_reserved)
        metrics.KV_PAGES_USED.set(kv.num_used_pages)
        metrics.KV_PAGES_FREE.set(kv.num_free_pages)
        metrics.KV_PAGES_QUARANTINED.set(kv.num_quarantined_pages)
        metrics.KV_CACHE_USAGE.set(1.0 - kv.num_free_pages / kv.num_total_pages)
