"""Worker registry: every known worker, its readiness, and the requests routed to it.

A background task polls each worker's ``grpc.health.v1`` ``Check`` every interval. A
worker that answers not SERVING, or cannot be reached, is ejected: no new request is routed
to it. A check that times out is ambiguous (a worker, or this router, busy with a burst of big
requests misses one): a ready worker is ejected by ``eject_timeouts`` in a row. A worker never
ready yet is admitted at its first passing check; an ejected one
is readmitted only after ``readmit_passes`` consecutive passing checks, so a worker whose check
flaps (pass, fail, pass) gets no traffic between its failures. Requests already on a
worker that dies or stalls fail through their own calls (the pipeline bounds each one),
not through the registry; the pipeline records a stall here (``record_stall``) and may
ask for another worker of the kind (``acquire(kind, exclude=...)``).

Health-check generate (``health_generate.py``): each worker's part of a completed request
is recorded (``record_completed``); a worker that completed nothing for a while gets a
one-token generate pinned to it (``pin``: within that generate's task, ``acquire`` of its
kind returns it). A failed generate ejects the worker whose call failed or was in flight
(``record_failure``; the pinned one when none was) until a generate passes
(``record_generate``).

Membership: the workers of a static address list are there from the start; discovery
(``discovery.py``) adds and retires the others. A worker ``join``s not ready (UNKNOWN) and is
routed to only once a health check passes. A worker that ``leave``s gets no new request; the
ones it holds finish or fail through their own calls as above, and once it has held none for a
grace period (its last Aborts have run) ``drop_idle`` forgets it and closes its channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from services.common.errors import UnavailableError
from services.common.healthcheck import HealthAnswer
from services.common.types import TokenizedPrompt
from services.router.health_probe import HealthProbe
from services.router.metrics import RouterMetrics
from services.router.policy import BaseRoutingPolicy
from services.router.workers import Hop, Worker, WorkerKind, WorkerState

logger = logging.getLogger(__name__)

ROUTED_KINDS = (WorkerKind.TOKENIZER, WorkerKind.PREFILL, WorkerKind.DECODE)


@dataclass
class PinnedCheck:
    """One health-check generate: its worker, and the workers whose calls failed in it (in
    order)."""

    worker: Worker
    failed: list[Worker] = field(default_factory=list)  # shared with the generate's child tasks
    # ejected workers of other kinds the generate went through (no ready one of their kind)
    suspects: list[Worker] = field(default_factory=list)
    is_inconclusive: bool = False  # another kind had no worker to go through at all

    @property
    def culprit(self) -> Worker:
        return self.failed[-1] if self.failed else self.worker


# The health-check generate running in this task (and the tasks it starts), if any
_PINNED: contextvars.ContextVar[PinnedCheck | None] = contextvars.ContextVar(
    "pinned_check", default=None
)


class WorkerRegistry:
    def __init__(
        self,
        workers: Sequence[Worker],
        policy: BaseRoutingPolicy,
        metrics: RouterMetrics,
        probe: HealthProbe,
        on_poll: Callable[[], None] | None = None,
        required_kinds: Collection[WorkerKind] = (),
        readmit_passes: int = 1,
        eject_timeouts: int = 1,
    ) -> None:
        """``required_kinds``: kinds besides the routed ones that need a ready worker (those
        configured, including ones discovery has not found yet); ``readmit_passes``: the
        consecutive passing checks that readmit an ejected worker; ``eject_timeouts``: the
        consecutive timed-out checks that eject a ready one."""
        self._workers = list(workers)
        self._readmit_passes = readmit_passes
        self._eject_timeouts = eject_timeouts
        self._policy = policy
        self._metrics = metrics
        self._probe = probe
        self._on_poll = on_poll
        self._poller: asyncio.Task | None = None
        self.required_kinds = tuple(
            k
            for k in WorkerKind
            if k in ROUTED_KINDS or k in required_kinds or any(w.kind is k for w in self._workers)
        )
        self._publish()

    def workers(self, kind: WorkerKind | None = None) -> list[Worker]:
        return [w for w in self._workers if kind is None or w.kind is kind]

    def ready_workers(self, kind: WorkerKind) -> list[Worker]:
        return [w for w in self._workers if w.kind is kind and w.is_ready]

    def suspects(self, kind: WorkerKind) -> list[Worker]:
        """Workers of ``kind`` that answer their health checks but are ejected by a failed
        health-check generate."""
        return [
            w
            for w in self._workers
            if w.kind is kind
            and w.state is WorkerState.READY
            and w.generate_error
            and not w.is_leaving
        ]

    def missing_kinds(self) -> list[WorkerKind]:
        """Kinds the router needs that have no ready worker now."""
        return [k for k in self.required_kinds if not self.ready_workers(k)]

    @property
    def is_ready(self) -> bool:
        return not self.missing_kinds()

    # ------------------------------------------------------------ routing

    def has_ready(self, kind: WorkerKind, exclude: Collection[Worker] = ()) -> bool:
        """Whether a ready worker of ``kind`` outside ``exclude`` exists now (inside ``pin``: the
        pinned one)."""
        check = _PINNED.get()
        if check is not None and check.worker.kind is kind:
            return check.worker not in exclude
        return any(w not in exclude for w in self.ready_workers(kind))

    def acquire(
        self,
        kind: WorkerKind,
        exclude: Collection[Worker] = (),
        prompt: TokenizedPrompt | None = None,
    ) -> Worker:
        """Choose a ready worker of ``kind`` (not one in ``exclude``) for a request with
        ``prompt`` (the policy may route on it) and count one more request on it.

        ``UnavailableError`` at once when none is ready. Pair with ``release``. Inside ``pin(w)``,
        ``acquire(w.kind)`` is ``w`` whatever its state (a health-check generate targets it).
        """
        check = _PINNED.get()
        pinned = check.worker if check is not None else None
        if pinned is not None and pinned.kind is kind:
            if pinned in exclude:
                raise UnavailableError(
                    f"the health-check generate's {kind.value} worker {pinned.address} failed"
                )
            return self._count(pinned)
        ready = self.ready_workers(kind)
        candidates = [w for w in ready if w not in exclude]
        if not candidates and check is not None:
            # a health-check generate needs the whole path: with no ready worker of another
            # kind it goes through one that is serving but ejected by its own check, so two
            # kinds ejected at once can still clear each other (each check would otherwise
            # fail for lack of the other, and blame its own worker, for good)
            candidates = [w for w in self.suspects(kind) if w not in exclude]
            check.suspects.extend(candidates[:1])
            check.is_inconclusive = not candidates  # says nothing of its own worker
        if not candidates:
            configured = len(self.workers(kind))
            other = " other" if exclude else ""
            raise UnavailableError(
                f"no{other} ready {kind.value} worker ({configured} configured, {len(ready)} ready)"
            )
        return self._count(self._policy.choose(kind, candidates, prompt))

    def _count(self, worker: Worker) -> Worker:
        worker.num_in_flight += 1
        self._metrics.worker_in_flight.labels(worker.kind.value, worker.address).set(
            worker.num_in_flight
        )
        return worker

    def release(self, worker: Worker) -> None:
        assert worker.num_in_flight > 0, f"release without acquire on {worker.address}"
        worker.num_in_flight -= 1
        if worker.num_in_flight == 0:
            worker.idle_since_mono = time.monotonic()
        self._metrics.worker_in_flight.labels(worker.kind.value, worker.address).set(
            worker.num_in_flight
        )

    def record_stall(self, worker: Worker, hop: Hop) -> None:
        """Count a call ``worker`` made no progress on within the stall bound (metric, /health)."""
        worker.num_stalls += 1
        self._metrics.worker_stalls.labels(hop.value, worker.address).inc()
        logger.warning("%s worker %s stalled in %s", worker.kind.value, worker.address, hop.value)

    def record_completed(self, worker: Worker) -> None:
        """``worker`` completed its part of a request (tokenized, prefilled, or decoded to the
        end)."""
        worker.last_completed_mono = time.monotonic()

    def record_generate(self, worker: Worker, error: str) -> None:
        """The outcome of a health-check generate on ``worker``: "" readmits it, a reason ejects
        it."""
        if error and not worker.generate_error:
            logger.warning(
                "%s worker %s failed its health-check generate: %s",
                worker.kind.value,
                worker.address,
                error,
            )
            self._policy.forget(worker)
        elif not error and worker.generate_error:
            logger.info(
                "%s worker %s passed its health-check generate", worker.kind.value, worker.address
            )
        worker.generate_error = error
        if not error:
            self.record_completed(worker)
        self._publish()
        if self._on_poll is not None:
            self._on_poll()

    def record_failure(self, worker: Worker) -> None:
        """A call on ``worker`` failed or was cancelled; inside ``pin``, its check blames it."""
        check = _PINNED.get()
        if check is not None:
            check.failed.append(worker)

    @contextlib.contextmanager
    def pin(self, worker: Worker) -> Iterator[PinnedCheck]:
        """Route this task's calls of ``worker.kind`` (and those of tasks it starts) to
        ``worker``."""
        check = PinnedCheck(worker)
        token = _PINNED.set(check)
        try:
            yield check
        finally:
            _PINNED.reset(token)

    @contextlib.contextmanager
    def lease(self, kind: WorkerKind) -> Iterator[Worker]:
        worker = self.acquire(kind)
        try:
            yield worker
        finally:
            self.release(worker)

    # ------------------------------------------------------------ membership

    def join(self, worker: Worker) -> None:
        """Add ``worker`` (or take a leaving one back); not routed to until a check passes."""
        if worker not in self._workers:
            self._workers.append(worker)
        logger.info("%s worker %s joined", worker.kind.value, worker.address)
        worker.is_leaving, worker.state = False, WorkerState.UNKNOWN
        self._changed()

    def leave(self, worker: Worker) -> None:
        """Route no new request to ``worker``; ``drop_idle`` forgets it once it holds none."""
        logger.info(
            "%s worker %s left (%d requests in flight on it)",
            worker.kind.value,
            worker.address,
            worker.num_in_flight,
        )
        worker.is_leaving = True
        self._policy.forget(worker)
        if worker.num_in_flight == 0:
            worker.idle_since_mono = time.monotonic()
        self._changed()

    async def drop_idle(self, grace_s: float) -> list[Worker]:
        """Forget the leaving workers that held no request for ``grace_s``; close their
        channels."""
        now = time.monotonic()
        dropped = [
            w
            for w in self._workers
            if w.is_leaving and w.num_in_flight == 0 and now - w.idle_since_mono >= grace_s
        ]
        self._workers = [w for w in self._workers if w not in dropped]
        for worker in dropped:
            for gauge in (self._metrics.worker_ready, self._metrics.worker_in_flight):
                with contextlib.suppress(KeyError):  # a series never set
                    gauge.remove(worker.kind.value, worker.address)
            if worker.client is not None:
                await worker.client.close()
            await self._probe.forget(worker.address)
        return dropped

    def _changed(self) -> None:
        self._publish()
        if self._on_poll is not None:
            self._on_poll()

    # ------------------------------------------------------------ health

    async def poll_once(self, workers: Collection[Worker] | None = None) -> None:
        """Check every worker (or those of ``workers``) once, concurrently, and update its
        state."""
        polled = list(self._workers if workers is None else workers)
        answers = await asyncio.gather(*(self._probe.check(w.address) for w in polled))
        for worker, answer in zip(polled, answers, strict=True):
            reason = answer.why_not_serving
            self._set_state(worker, self._next_state(worker, answer), reason or "")
        self._publish()
        if self._on_poll is not None:
            self._on_poll()

    def _next_state(self, worker: Worker, answer: HealthAnswer) -> WorkerState:
        """The state one check moves ``worker`` to."""
        if answer.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            worker.num_timeouts += 1
            if worker.state is WorkerState.READY and worker.num_timeouts < self._eject_timeouts:
                logger.warning(
                    "%s worker %s missed health check %d of %d before ejection",
                    worker.kind.value,
                    worker.address,
                    worker.num_timeouts,
                    self._eject_timeouts,
                )
                return WorkerState.READY
        else:
            worker.num_timeouts = 0
        if not answer.is_serving:
            worker.num_passes = 0
            return WorkerState.NOT_READY
        worker.num_passes += 1
        if worker.state is WorkerState.NOT_READY and worker.num_passes < self._readmit_passes:
            return WorkerState.NOT_READY
        return WorkerState.READY

    def _set_state(self, worker: Worker, state: WorkerState, reason: str) -> None:
        if state is not worker.state:
            if state is WorkerState.READY:
                logger.info("%s worker %s is ready", worker.kind.value, worker.address)
            else:  # whatever it held may be gone (a restart empties a worker's caches)
                self._policy.forget(worker)
                logger.warning(
                    "%s worker %s is not ready: %s", worker.kind.value, worker.address, reason
                )
        worker.state, worker.last_error = state, reason

    def _publish(self) -> None:
        for worker in self._workers:
            self._metrics.worker_ready.labels(worker.kind.value, worker.address).set(
                int(worker.is_ready)
            )
        for kind in WorkerKind:
            self._metrics.workers_ready.labels(kind.value).set(len(self.ready_workers(kind)))

    async def _poll_forever(self, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))

    def start(self, interval_s: float) -> None:
        """Poll in the background every ``interval_s`` until ``close``."""
        assert self._poller is None, "already started"
        self._poller = asyncio.create_task(
            self._poll_forever(interval_s), name="router-health-poll"
        )
        self._poller.add_done_callback(_log_poller_exit)

    async def close(self) -> None:
        """Stop polling and close every worker's client and the probe's channels."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for worker in self._workers:
            if worker.client is not None:
                await worker.client.close()
        await self._probe.close()


def _log_poller_exit(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("worker health polling stopped", exc_info=task.exception())
