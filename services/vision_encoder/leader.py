"""The encoder's leader: queues Encode calls, plans each batch, runs it on the ranks that own it.

Each of the W ranks is a rank group (``RankGroup``) of one process, or of ``--tp`` processes
that run every step alike (TP rank 0's result is the rank's; the others' are empty): the ranks
share no collective, so each is started, stepped and re-formed alone. The batch loop is one
asyncio task on the server's event loop: it takes a batch from the scheduler, planned
from the cache ledger over the ranks that serve, sends each rank that owns a span its
share of the batch as one step, to all of them at once (each payload is encoded on a
worker thread; each group's own thread does the waiting), and turns the ranks' results
into the jobs' outcomes, so the loop never blocks and no two batches run at once. Every
job ends with its results or an error: expired in the queue, failed in its step (a
rank's error for that job, or the step error of a rank it has a span on: the rank's
agreed error, or UNAVAILABLE when it died, hung or re-forms), or refused at shutdown.
The calls with no span on a failed rank finish normally. A rank that fail-stops loses
its cache: its ledger entries and cache gauges alone are cleared (``on_rank_down``). The
leader never touches a device. ``progress`` ticks when a batch is taken and when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

import msgspec

from services.common.clients.vision_encoder import SpanResult, SpanStatus
from services.common.errors import (
    DeadlineExceededError,
    ErrorRecord,
    StageServeError,
    UnavailableError,
)
from services.common.progress import ProgressWatchdog
from services.common.ranks.group import RankGroup
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.plan import CacheLedger, rank_payloads, step_payload
from services.vision_encoder.rank_messages import EncodeStepPayload, EncodeStepResult
from services.vision_encoder.scheduler import (
    BatchOutcome,
    EncodeBatch,
    EncodeScheduler,
    JobOutcome,
)

logger = logging.getLogger(__name__)


class EncoderLeader:
    def __init__(
        self,
        scheduler: EncodeScheduler,
        groups: Sequence[RankGroup],
        metrics: VisionEncoderMetrics,
        *,
        watchdog_s: float = 30.0,
    ) -> None:
        assert groups and len({g.num_ranks for g in groups}) == 1, "ranks of one size"
        self.scheduler = scheduler
        self.groups = tuple(groups)  # rank r: groups[r]
        self.ledger = CacheLedger(len(self.groups))
        self.metrics = metrics
        self._pending: dict[int, tuple[asyncio.Future[list[SpanResult]], float]] = {}
        self._wake = asyncio.Event()
        self._is_stopping = False
        self._job_ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self.progress = ProgressWatchdog(  # run by the caller (``progress.start``)
            "vision encoder",
            watchdog_s,
            lambda: bool(self._pending),
            is_alive=self._is_alive,
            stalled_gauge=metrics.stalled,
        )

    @property
    def num_ranks(self) -> int:
        return len(self.groups)

    @property
    def rank_pids(self) -> tuple[int, ...]:
        """Each rank's current processes (--tp of them), in rank order (none for a rank between
        formations)."""
        return tuple(pid for group in self.groups for pid in group.rank_pids)

    def serving_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, group in enumerate(self.groups) if group.is_ready)

    @property
    def num_pending(self) -> int:
        """Calls waiting for a batch or in one."""
        return len(self._pending)

    def next_job_id(self) -> int:
        return next(self._job_ids)

    async def start(self) -> None:
        """Form every rank's group at once, then run the loop; if one fails to start, stop
        them all and raise its ``RankStartError`` (naming the rank and cause)."""
        starts = [asyncio.ensure_future(group.start()) for group in self.groups]
        await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in starts if t.done() and t.exception() is not None]
        if failed:
            await self._close_groups()
            await asyncio.gather(*starts, return_exceptions=True)
            raise failed[0].exception()  # type: ignore[misc]
        self._task = asyncio.get_running_loop().create_task(self._run(), name="encoder-batches")

    def on_rank_down(self, rank: int) -> None:
        """``rank`` fail-stopped: it comes back with an empty cache (the others keep theirs)."""
        self.ledger.clear_rank(rank)
        self.metrics.cache_bytes.labels(rank=str(rank)).set(0)
        self.metrics.cache_entries.labels(rank=str(rank)).set(0)

    async def stop(self) -> None:
        """Stop every rank (the batch in flight fails UNAVAILABLE), fail every waiting job."""
        self.progress.stop()
        self._is_stopping = True
        self._wake.set()
        await self._close_groups()
        if self._task is not None:
            await self._task

    async def _close_groups(self) -> None:
        await asyncio.gather(*(group.aclose() for group in self.groups))

    async def encode(self, job: EncodeJob) -> list[SpanResult]:
        """Queue ``job`` (already validated) and wait for its span results, or raise its error."""
        if not job.spans:
            return []
        if self._is_stopping:
            raise UnavailableError("the vision encoder is shutting down")
        future: asyncio.Future[list[SpanResult]] = asyncio.get_running_loop().create_future()
        self._pending[job.job_id] = (future, time.monotonic())
        self.scheduler.add(job)
        self._set_queue_gauges()
        self._wake.set()
        try:
            return await future
        finally:
            self._pending.pop(job.job_id, None)  # its caller is gone: its outcome goes nowhere

    def _set_queue_gauges(self) -> None:
        self.metrics.queue_depth.set(self.scheduler.num_waiting)
        self.metrics.saturation.set(self.scheduler.saturation)

    def _is_alive(self) -> bool:
        return self._task is None or not self._task.done()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not self._is_stopping and self.scheduler.num_waiting:
                now, serving = time.monotonic(), self.serving_ranks()
                batch = self.scheduler.schedule(now, self.ledger, serving)
                self._set_queue_gauges()
                self.progress.tick()
                for job in batch.expired:
                    error = DeadlineExceededError(
                        f"encode of {job.request_id} waited past its deadline"
                    )
                    self._finish(job, error)
                for job, results in batch.needs_data:  # nothing written: the caller resends
                    self._finish(job, results)
                if batch.jobs:
                    await self._run_batch(batch)
                    self.progress.tick()
            if self._is_stopping:
                for job in self.scheduler.drain():
                    self._finish(job, UnavailableError("the vision encoder is shutting down"))
                return

    async def _run_batch(self, batch: EncodeBatch) -> None:
        try:
            payload = step_payload(batch.jobs, batch.plan, time.monotonic())
            shares = rank_payloads(payload)
            outcomes = await asyncio.gather(*(self._step(r, p) for r, p in shares.items()))
            results = [o for o in outcomes if isinstance(o, EncodeStepResult)]
            failed = {
                r: o
                for r, o in zip(shares, outcomes, strict=True)
                if isinstance(o, StageServeError)
            }
            outcome = self._fold(batch, results, failed)
        except Exception as exc:  # a bug here must still end every call of the batch
            logger.exception("encode batch of %d calls failed", len(batch.jobs))
            for job in batch.jobs:
                self._finish(job, exc)
            return
        self.scheduler.requeue([j for j in outcome.replanned if j.job_id in self._pending])
        for job, job_outcome in outcome.finished:
            self._finish(job, job_outcome)

    def _fold(
        self,
        batch: EncodeBatch,
        results: list[EncodeStepResult],
        failed: dict[int, StageServeError],
    ) -> BatchOutcome:
        """The ranks' results into the metrics, the ledger and the calls' outcomes."""
        for result in results:
            self.metrics.record_step(result)
        if self.ledger.update_from_results(batch.plan, results):
            logger.warning("a rank's cache disagreed with the ledger: its calls are planned again")
        return self.scheduler.update_from_output(batch, results, failed)

    async def _step(
        self, rank: int, payload: EncodeStepPayload
    ) -> EncodeStepResult | StageServeError:
        """``rank``'s share of the batch: its result, or its step's error naming the rank."""
        group = self.groups[rank]
        try:
            # Encoding the payload copies its images' bytes: off the event loop.
            future: Future = await asyncio.to_thread(group.submit, payload)
            result = (await asyncio.wrap_future(future))[0]  # TP rank 0's; the others' empty
        except StageServeError as exc:  # its agreed error, or UNAVAILABLE (died, hung, re-forms)
            error = _naming(exc, group.config.name)
            logger.warning("%d calls' share failed: %s", len(payload.jobs), error.message)
            return error
        assert isinstance(result, EncodeStepResult) and result.rank == rank
        return result

    def _finish(self, job: EncodeJob, outcome: JobOutcome) -> None:
        entry = self._pending.pop(job.job_id, None)
        if entry is None:  # the caller went away
            return
        future, arrival = entry
        m = self.metrics
        if isinstance(outcome, BaseException):
            m.requests.labels(outcome=type(outcome).__name__).inc()
        elif any(r.status is SpanStatus.NEEDS_IMAGE_DATA for r in outcome):
            m.requests.labels(outcome="needs_image_data").inc()
        elif job.cache_only:  # its spans are counted by the call that writes them
            m.requests.labels(outcome="ok").inc()
            m.cache_only_spans.inc(len(outcome))
        else:
            m.requests.labels(outcome="ok").inc()
            num_hits = sum(r.is_cache_hit for r in outcome)
            m.cache_hits.inc(num_hits)
            m.cache_misses.inc(len(outcome) - num_hits)
            m.mm_cache_queries.inc(len(outcome))
            m.mm_cache_hits.inc(num_hits)
        latency = m.cache_only_latency if job.cache_only else m.encode_latency
        latency.observe(time.monotonic() - arrival)
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _naming(exc: StageServeError, name: str) -> StageServeError:
    """``exc`` with its text led by ``name`` (its rank group's), unless it already is."""
    if exc.message.startswith(f"{name}:"):
        return exc
    record = ErrorRecord.of(exc)
    return msgspec.structs.replace(record, message=f"{name}: {exc.message}").to_error(type(exc))
