"""Health-check generate: a worker that completed no request for a while runs a tiny one.

Every ``interval_s`` the checker looks at each routed worker (tokenizer, prefill, decode)
that answers its health check: one that completed its part of a request within the last
``interval_s`` passes by that traffic (piggyback); any other gets a generate of
``HEALTH_TOKENS`` tokens through the whole path (tokenize, Reserve, Prefill, one decode
step) with every call of its kind pinned to it. A generate that fails or passes
``timeout_s`` ejects the worker whose call failed or was in flight then (the checked one
when none was) until a generate pinned to it passes; an ejected worker is checked every
interval. A generate that finds no ready worker of another kind goes through an ejected one
that still answers its health check (``WorkerRegistry.acquire``), so two kinds ejected at once
clear each other, and a pass readmits every worker it went through; with none at all (that
kind is down) it blames nobody. Admission of the generate is the workers' own
(the prefill leader decides it like any request's).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from services.common.errors import StageServeError
from services.common.types import SamplingParams
from services.router.generation import GenerationPipeline
from services.router.registry import ROUTED_KINDS, WorkerRegistry
from services.router.types import GenerationRequest
from services.router.workers import Worker, WorkerState

logger = logging.getLogger(__name__)
HEALTH_PROMPT = "ping"
HEALTH_TOKENS = 2  # the first from prefill, one decode step: Generate runs too
HEALTH_ID_PREFIX = "health-"


class HealthGenerateChecker:
    def __init__(
        self,
        registry: WorkerRegistry,
        pipeline: GenerationPipeline,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert interval_s > 0 and timeout_s > 0
        self._registry, self._pipeline = registry, pipeline
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._clock = clock
        self._task: asyncio.Task | None = None

    def due(self) -> list[Worker]:
        """Workers that answer health checks but completed nothing for ``interval_s``, or are
        ejected."""
        now = self._clock()
        return [
            w
            for kind in ROUTED_KINDS
            for w in self._registry.workers(kind)
            if w.state is WorkerState.READY
            and not w.is_leaving
            and (w.generate_error or now - w.last_completed_mono >= self.interval_s)
        ]

    async def check_once(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.due()))

    async def check(self, worker: Worker) -> None:
        """One generate pinned to ``worker``; its outcome ejects or readmits it."""
        request = GenerationRequest(
            f"{HEALTH_ID_PREFIX}{uuid.uuid4().hex}",
            prompt=HEALTH_PROMPT,
            params=SamplingParams(temperature=0.0, ignore_eos=True),
            max_tokens=HEALTH_TOKENS,
            timeout_s=self.timeout_s,
        )
        error = ""
        with self._registry.pin(
            worker
        ) as check:  # the pipeline's task starts inside: it inherits the pin
            try:
                async for delta in self._pipeline.stream(request):
                    if delta.finish_reason is not None:
                        break
                else:
                    error = "the generate ended without a finish reason"
            except StageServeError as exc:
                error = exc.message
        if error:
            if not (check.is_inconclusive and not check.failed):
                self._registry.record_generate(check.culprit, error)
            return
        for passed in (worker, *check.suspects):  # the whole path passed: each worker on it
            self._registry.record_generate(passed, "")

    async def _run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except (
                Exception
            ):  # the checker's last resort: dead, no idle worker would be checked again
                logger.exception("health-check generate round failed")

    def start(self) -> None:
        assert self._task is None, "already started"
        self._task = asyncio.create_task(self._run_forever(), name="router-health-generate")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
