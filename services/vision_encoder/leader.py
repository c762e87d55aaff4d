"""The encoder's leader: queues Encode calls, plans each batch, runs it as one step on its ranks.

The batch loop is one asyncio task on the server's event loop: it takes a batch from the
scheduler, plans it from the cache ledger, hands it to the rank group as one step (the
payload is encoded on a worker thread; the group's own thread does the waiting) and
turns every rank's result into the jobs' outcomes, so the loop never blocks and no two
batches run at once. Every job ends with its results or an error: expired in the queue,
failed in its step (a rank's error for that job, or the step's agreed error for all of
them, or UNAVAILABLE when a rank died), or refused at shutdown. The leader never touches
a device. ``progress`` ticks when a batch is taken and when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import Future

from services.common.clients.vision_encoder import SpanResult, SpanStatus
from services.common.errors import DeadlineExceededError, StageServeError, UnavailableError
from services.common.progress import ProgressWatchdog
from services.common.ranks.group import RankGroup
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.plan import CacheLedger, step_payload
from services.vision_encoder.rank_messages import EncodeStepResult
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
        group: RankGroup,
        metrics: VisionEncoderMetrics,
        *,
        watchdog_s: float = 30.0,
    ) -> None:
        self.scheduler = scheduler
        self.group = group
        self.ledger = CacheLedger(group.num_ranks)
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
        return self.group.num_ranks

    @property
    def num_pending(self) -> int:
        """Calls waiting for a batch or in one."""
        return len(self._pending)

    def next_job_id(self) -> int:
        return next(self._job_ids)

    async def start(self) -> None:
        """Form the rank group (``RankStartError`` naming the rank and cause), then run the loop."""
        await self.group.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="encoder-batches")

    def on_group_down(self) -> None:
        """The rank group fail-stopped: its ranks come back with empty caches."""
        self.ledger.clear()
        for rank in range(self.num_ranks):
            self.metrics.cache_bytes.labels(rank=str(rank)).set(0)
            self.metrics.cache_entries.labels(rank=str(rank)).set(0)

    async def stop(self) -> None:
        """Stop the rank group (the batch in flight fails UNAVAILABLE), fail every waiting job."""
        self.progress.stop()
        self._is_stopping = True
        self._wake.set()
        await self.group.aclose()
        if self._task is not None:
            await self._task

    async def encode(self, job: EncodeJob) -> list[SpanResult]:
        """Queue ``job`` (already validated) and wait for its span results, or raise its error."""
        if not job.spans:
            return []
        if self._is_stopping:
            raise UnavailableError("the vision encoder is shutting down")
        future: asyncio.Future[list[SpanResult]] = asyncio.get_running_loop().create_future()
        self._pending[job.job_id] = (future, time.monotonic())
        self.scheduler.add(job)
        self.metrics.queue_depth.set(self.scheduler.num_waiting)
        self._wake.set()
        try:
            return await future
        finally:
            self._pending.pop(job.job_id, None)  # its caller is gone: its outcome goes nowhere

    def _is_alive(self) -> bool:
        return self._task is None or not self._task.done()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not self._is_stopping and self.scheduler.num_waiting:
                batch = self.scheduler.schedule(time.monotonic(), self.ledger)
                self.metrics.queue_depth.set(self.scheduler.num_waiting)
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
            outcome = self._fold(batch, await self._step(batch))
        except StageServeError as exc:  # the step's agreed error, or UNAVAILABLE (a rank died)
            logger.warning("encode batch of %d calls failed: %s", len(batch.jobs), exc.message)
            for job in batch.jobs:
                self._finish(job, exc)
            return
        except Exception as exc:  # a bug here must still end every call of the batch
            logger.exception("encode batch of %d calls failed", len(batch.jobs))
            for job in batch.jobs:
                self._finish(job, exc)
            return
        self.scheduler.requeue([j for j in outcome.replanned if j.job_id in self._pending])
        for job, job_outcome in outcome.finished:
            self._finish(job, job_outcome)

    def _fold(self, batch: EncodeBatch, results: list[EncodeStepResult]) -> BatchOutcome:
        """Every rank's result into the metrics, the ledger and the calls' outcomes."""
        for result in results:
            self.metrics.record_step(result)
        if self.ledger.update_from_results(batch.plan, results):
            logger.warning("a rank's cache disagreed with the ledger: its calls are planned again")
        return self.scheduler.update_from_output(batch, results)

    async def _step(self, batch: EncodeBatch) -> list[EncodeStepResult]:
        payload = step_payload(batch.jobs, batch.plan, time.monotonic())
        # Encoding the payload copies every image's bytes: off the event loop.
        future: Future = await asyncio.to_thread(self.group.submit, payload)
        results = await asyncio.wrap_future(future)
        assert all(isinstance(r, EncodeStepResult) for r in results)
        return results

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
