"""Prefill leader: admits requests, drives Encode calls, hands plans to the rank worker, answers callers.

Runs on the event loop; everything that touches the scheduler happens on the loop's
thread. The rank worker's ``execute(plan)`` runs on its own thread (a one-thread
executor); its "forward done" signal and its result come back through the loop
(``call_soon_threadsafe``). Each caller awaits its request's future until the request's
deadline; a caller that gives up (deadline, cancellation) aborts its request, whose
resources are then released wherever it is. ``progress`` ticks when a plan is launched,
its forward is done and the plan is done; readiness follows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec
from opentelemetry import context as otel_context

from services.common import telemetry
from services.common.clients.vision_encoder import EncodeSpanInput, SpanResult, SpanStatus
from services.common.errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.common.progress import ProgressWatchdog
from services.prefill import metrics
from services.prefill.request import PrefillInput, PrefillOutput, PrefillPlan, ReqStatus, RequestOutcome
from services.prefill.scheduler import PrefillScheduler, SchedEntry
from services.prefill.validation import PromptLimits, prompt_destination, validate_prompt
from services.prefill.worker import PrefillRankWorker
from services.transfer.base import pool_layout
from services.transfer.embeddings import BaseEmbeddingReceiver, EmbeddingDestination

logger = logging.getLogger(__name__)
TICK_S = 0.05  # deadline sweep and row-quarantine release period


class Encoder(Protocol):
    """What the leader needs of the vision encoder (``VisionEncoderClient`` is one)."""

    async def encode(
        self, request_id: str, spans: Sequence[EncodeSpanInput], destination: EmbeddingDestination, timeout_s: float
    ) -> list[SpanResult]: ...


def spans_error(request: PrefillInput, results: Sequence[SpanResult]) -> StageServeError | None:
    """The error a request fails with given its per-span Encode results; None when all are written."""
    if len(results) != len(request.spans):
        return UnavailableError(f"the encoder answered {len(results)} results for {len(request.spans)} spans")
    for i, result in enumerate(results):
        if result.status is SpanStatus.INVALID_IMAGE:
            return InvalidRequestError(f"image_spans[{i}]: invalid image: {result.error_message}", param="images")
        if result.status is not SpanStatus.WRITTEN:
            return UnavailableError(f"encoding image_spans[{i}] failed: {result.error_message or result.status}")
    return None


class PrefillLeader:
    def __init__(
        self,
        scheduler: PrefillScheduler,
        worker: PrefillRankWorker,
        embedding_receiver: BaseEmbeddingReceiver,
        encoder: Encoder | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        watchdog_s: float = 30.0,
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.embedding_receiver = embedding_receiver
        self.encoder = encoder
        self.limits = PromptLimits.from_config(worker.runner.model.config)
        self._local_layout = pool_layout(worker.runner.kv_pool)
        self._clock = clock
        self._futures: dict[str, asyncio.Future[RequestOutcome]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-rank0")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._is_stopping = False
        # Progress: a plan launched, its forward done, the plan done. Run by the caller (``progress.start``).
        self.progress = ProgressWatchdog(
            "prefill", watchdog_s, lambda: scheduler.has_worker_work, clock=clock, stalled_gauge=metrics.STALLED
        )

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ticker = self._loop.create_task(self._tick_forever())

    async def stop(self) -> None:
        """Fail every live request (UNAVAILABLE), wait for the running plan, stop the rank thread."""
        self._is_stopping = True
        self.progress.stop()
        if self._ticker is not None:
            self._ticker.cancel()
        for request_id, future in list(self._futures.items()):
            if not future.done():
                future.set_exception(UnavailableError(f"prefill worker shut down before {request_id} finished"))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    # --- the caller's side -----------------------------------------------------------
    async def prefill(self, request: PrefillInput, images: dict[str, bytes]) -> RequestOutcome:
        """Validate, queue and wait for ``request``; raises its error (``StageServeError``)."""
        start, label = self._clock(), "internal"
        try:
            outcome = await self._prefill(request, images)
            label = "ok"
            metrics.LATENCY_S.observe(self._clock() - start)
            return outcome
        except StageServeError as exc:
            label = metrics.outcome_label(exc)
            raise
        except asyncio.CancelledError:
            label = "cancelled"
            raise
        finally:
            metrics.REQUESTS.labels(label).inc()

    async def _prefill(self, request: PrefillInput, images: dict[str, bytes]) -> RequestOutcome:
        if self._is_stopping or self._loop is None:
            raise UnavailableError("prefill worker is not running")
        request = self._validated(request, images)
        self.scheduler.add(request, images)
        future = self._loop.create_future()
        self._futures[request.request_id] = future
        try:
            self._pump()
            return await self._wait(request, future)
        finally:
            self._futures.pop(request.request_id, None)
            if not future.done():  # the caller gave up (deadline, cancellation) or an error
                gone = AbortedError(f"the caller of {request.request_id} is gone")
                self._abort(request.request_id, gone)

    def _validated(self, request: PrefillInput, images: dict[str, bytes]) -> PrefillInput:
        validate_prompt(request.token_ids, request.spans, images, request.params, self.limits)
        if request.spans and self.encoder is None:
            raise UnavailableError("this prefill worker has no vision encoder (--encoder-address)")
        kv_dst = prompt_destination(
            request.kv_dst, self._local_layout, request.num_tokens, self.worker.kv_sender.backend
        )
        kind = PrefillScheduler.kind_of(request.num_image_tokens)
        return msgspec.structs.replace(request, kv_dst=kv_dst, kind=kind)

    async def _wait(self, request: PrefillInput, future: asyncio.Future[RequestOutcome]) -> RequestOutcome:
        request_id = request.request_id
        try:
            async with asyncio.timeout(max(request.deadline - self._clock(), 0.0)):
                outcome = await asyncio.shield(future)
        except TimeoutError:
            raise DeadlineExceededError(f"prefill of {request_id} passed its deadline") from None
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def _abort(self, request_id: str, error: StageServeError) -> None:
        if not self._is_stopping:
            self.scheduler.abort(request_id, error)
            self._pump()

    def _resolve(self, outcomes: Sequence[RequestOutcome]) -> None:
        for outcome in outcomes:
            future = self._futures.get(outcome.request_id)
            if future is not None and not future.done():
                future.set_result(outcome)

    # --- driving the scheduler ---------------------------------------------------------
    def _pump(self) -> None:
        """Expire, admit (start Encodes), and launch a plan if the worker is idle."""
        if self._is_stopping:
            return
        self._resolve(self.scheduler.expire())
        for entry in self.scheduler.admit():
            self._spawn(self._encode(entry))
        plan = self.scheduler.schedule()
        if plan is not None:
            self._launch(plan)
        metrics.EMBEDDING_ROWS_USED.set(self.scheduler.num_rows_used)
        metrics.QUEUED.set(sum(self.scheduler.num_in(s) for s in (ReqStatus.QUEUED, ReqStatus.ENCODING, ReqStatus.READY)))

    async def _tick_forever(self) -> None:
        """Pump every ``TICK_S``; a failing pump is logged and retried (expiry and quarantine need it)."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._pump()
            except Exception:  # the ticker's last resort: dead, it would leak every later deadline
                logger.exception("prefill scheduler tick failed")

    def _spawn(self, coro: object) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _launch(self, plan: PrefillPlan) -> None:
        assert self._loop is not None
        self.progress.tick()
        metrics.BATCH_SIZE.observe(len(plan.requests))
        metrics.BATCH_TOKENS.observe(plan.num_tokens)
        loop = self._loop

        def forward_done(done: PrefillPlan) -> None:  # on the rank thread
            loop.call_soon_threadsafe(self._on_forward_done, done)

        future = loop.run_in_executor(
            self._executor, self.worker.execute, plan, forward_done, self.scheduler.is_aborted
        )
        future.add_done_callback(lambda f: self._on_plan_done(plan, f))

    def _on_forward_done(self, plan: PrefillPlan) -> None:
        self.progress.tick()
        self.scheduler.mark_sending(plan)
        self._pump()

    def _on_plan_done(self, plan: PrefillPlan, future: asyncio.Future[PrefillOutput]) -> None:
        self.progress.tick()
        if future.cancelled():
            outcomes = self.scheduler.fail_plan(plan, UnavailableError("prefill worker shut down mid-batch"))
        elif (exc := future.exception()) is not None:
            logger.error("prefill batch %d failed", plan.plan_id, exc_info=exc)
            error = exc if isinstance(exc, StageServeError) else StageServeError(
                f"prefill forward failed: {type(exc).__name__}: {exc}"
            )
            outcomes = self.scheduler.fail_plan(plan, error)
        else:
            output = future.result()
            metrics.FORWARD_S.observe(output.forward_s)
            for outcome in output.outcomes:
                if outcome.is_ok:
                    metrics.KV_BYTES.inc(outcome.num_kv_bytes)
                    metrics.KV_TRANSFER_S.observe(outcome.kv_transfer_s)
            outcomes = self.scheduler.update_from_output(plan, output)
        self._resolve(outcomes)
        self._pump()

    async def _encode(self, entry: SchedEntry) -> None:
        """Encode ``entry``'s spans into its rows; ``finish_encoding`` runs on every path.

        Until the encoder answered it may still be writing the rows (timeout, cancellation,
        an unexpected failure), so they are quarantined then, freed otherwise.
        """
        request = entry.input
        error: StageServeError | None = None
        num_cached, may_still_write = 0, True
        token = otel_context.attach(telemetry.extract_context(request.trace_carrier.items()))
        try:
            results = await self._call_encoder(entry)
            error, may_still_write = spans_error(request, results), False
            num_cached = sum(s.length for s, r in zip(request.spans, results, strict=False) if r.is_cache_hit)
        except DeadlineExceededError as exc:  # the encoder may still be writing the rows
            error = exc
        except StageServeError as exc:
            error, may_still_write = exc, False
        except asyncio.CancelledError:  # the leader is stopping
            error = UnavailableError(f"prefill shut down while encoding {request.request_id}'s images")
            raise
        except Exception as exc:  # a bug here or in the encoder client: fail the request, keep serving
            logger.exception("encoding the images of %s failed", request.request_id)
            error = StageServeError(
                f"prefill failed to encode the images of {request.request_id}: internal error "
                f"({type(exc).__name__}; see prefill's log)"
            )
        finally:
            otel_context.detach(token)
            outcome = self.scheduler.finish_encoding(
                request.request_id, error, num_cached, may_still_write
            )
            if outcome is not None:
                self._resolve([outcome])
            self._pump()

    async def _call_encoder(self, entry: SchedEntry) -> list[SpanResult]:
        assert self.encoder is not None
        request = entry.input
        spans, dest_row = [], 0
        for span in request.spans:
            spans.append(EncodeSpanInput(span, entry.images[span.content_hash], dest_row))
            dest_row += span.length
        receiver = self.embedding_receiver
        destination = receiver.destination(request.request_id, entry.row_start, dest_row)
        return await self.encoder.encode(
            request.request_id, spans, destination, timeout_s=request.deadline - self._clock()
        )
