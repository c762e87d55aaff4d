"""Leader: queues Encode calls, plans each batch from the ranks' manifests, drives the rank worker.

The batch loop runs on one thread (``vision-encoder-engine``), so the asyncio event loop
never blocks on preprocessing, the ViT or a transfer, and two ViT forwards never run at
once. Results go back to the caller's event loop with ``call_soon_threadsafe``. Every
job ends with its results or an error: expired in the queue, failed in the batch, or
refused at shutdown. ``progress`` ticks when a batch is taken and when it ends; readiness
follows it while encodes are queued or in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from services.common.clients.vision_encoder import SpanResult
from services.common.errors import DeadlineExceededError, UnavailableError
from services.common.progress import ProgressWatchdog
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.plan import make_plan
from services.vision_encoder.scheduler import BatchResult, EncodeBatch, EncodeScheduler, JobOutcome
from services.vision_encoder.worker import EncoderWorker

logger = logging.getLogger(__name__)


class _Pending:
    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float) -> None:
        self.loop = loop
        self.future: asyncio.Future[list[SpanResult]] = loop.create_future()
        self.arrival = arrival


class EncoderLeader:
    def __init__(
        self,
        scheduler: EncodeScheduler,
        workers: Sequence[EncoderWorker],
        metrics: VisionEncoderMetrics,
        *,
        watchdog_s: float = 30.0,
    ) -> None:
        assert [w.rank for w in workers] == list(range(len(workers)))
        self.scheduler = scheduler
        self.workers = list(workers)
        self.metrics = metrics
        self._pending: dict[int, _Pending] = {}
        self._cond = threading.Condition()
        self._is_stopping = False
        self._job_ids = itertools.count()
        self._num_evictions_seen = 0
        self._thread = threading.Thread(target=self._run, name="vision-encoder-engine", daemon=True)
        self.progress = ProgressWatchdog(  # run by the caller (``progress.start``)
            "vision encoder", watchdog_s, lambda: bool(self._pending), is_alive=self._thread.is_alive,
            stalled_gauge=metrics.stalled,
        )

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def next_job_id(self) -> int:
        return next(self._job_ids)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the batch in progress, fail every waiting job with ``UnavailableError``, join the thread."""
        self.progress.stop()
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    async def encode(self, job: EncodeJob) -> list[SpanResult]:
        """Queue ``job`` (already validated) and wait for its span results, or raise its error."""
        if not job.spans:
            return []
        pending = _Pending(asyncio.get_running_loop(), time.monotonic())
        with self._cond:
            if self._is_stopping:
                raise UnavailableError("the vision encoder is shutting down")
            self._pending[job.job_id] = pending
            self.scheduler.add(job)
            self.metrics.queue_depth.set(self.scheduler.num_waiting)
            self._cond.notify()
        return await pending.future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._is_stopping and not self.scheduler.num_waiting:
                    self._cond.wait()
                if self._is_stopping:
                    refused = self.scheduler.drain()
                    break
                batch = self.scheduler.schedule(time.monotonic())
                self.metrics.queue_depth.set(self.scheduler.num_waiting)
            self.progress.tick()
            for job in batch.expired:
                self._finish(job, DeadlineExceededError(f"encode of {job.request_id} waited past its deadline"))
            if batch.jobs:
                self._run_batch(batch)
                self.progress.tick()
        for job in refused:
            self._finish(job, UnavailableError("the vision encoder is shutting down"))

    def _run_batch(self, batch: EncodeBatch) -> None:
        try:
            hashes = batch.content_hashes
            plan = make_plan(hashes, [w.manifest(hashes) for w in self.workers], self.world_size)
            result = BatchResult()
            for worker in self.workers:  # one rank here; more ranks run this on their own process
                self._merge(result, worker.execute(batch, plan))
            outcomes = self.scheduler.update_from_output(batch, plan, result)
        except BaseException as exc:  # handed to every caller of the batch; they raise it
            logger.exception("encode batch of %d jobs failed", len(batch.jobs))
            outcomes = [(job, exc) for job in batch.jobs]
            result = BatchResult()
        self._record(result)
        for job, outcome in outcomes:
            self._finish(job, outcome)

    @staticmethod
    def _merge(total: BatchResult, part: BatchResult) -> None:
        for job_id, error in part.errors.items():
            total.errors.setdefault(job_id, error)
        total.num_images_encoded += part.num_images_encoded
        total.num_vit_forwards += part.num_vit_forwards
        total.vit_s = max(total.vit_s, part.vit_s)
        total.num_bytes_sent += part.num_bytes_sent

    def _record(self, result: BatchResult) -> None:
        m = self.metrics
        m.images_encoded.inc(result.num_images_encoded)
        m.vit_forwards.inc(result.num_vit_forwards)
        if result.num_vit_forwards:
            m.vit_latency.observe(result.vit_s)
        m.transfer_bytes.inc(result.num_bytes_sent)
        cache = self.workers[0].cache
        m.cache_bytes.set(cache.num_bytes)
        m.cache_entries.set(cache.num_entries)
        m.cache_evictions.inc(cache.num_evictions - self._num_evictions_seen)
        self._num_evictions_seen = cache.num_evictions

    def _finish(self, job: EncodeJob, outcome: JobOutcome) -> None:
        with self._cond:
            pending = self._pending.pop(job.job_id, None)
        if pending is None:
            return
        m = self.metrics
        if isinstance(outcome, BaseException):
            m.requests.labels(outcome=type(outcome).__name__).inc()
        else:
            m.requests.labels(outcome="ok").inc()
            num_hits = sum(r.is_cache_hit for r in outcome)
            m.cache_hits.inc(num_hits)
            m.cache_misses.inc(len(outcome) - num_hits)
            m.mm_cache_queries.inc(len(outcome))
            m.mm_cache_hits.inc(num_hits)
        m.encode_latency.observe(time.monotonic() - pending.arrival)
        try:
            pending.loop.call_soon_threadsafe(_resolve, pending.future, outcome)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting
            logger.debug("dropped the outcome of %s: its event loop is closed", job.request_id)


def _resolve(future: asyncio.Future[list[SpanResult]], outcome: JobOutcome) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
