"""The router's request tasks and its drain.

Every task a request starts runs through ``RequestTasks``: its producer (``admit``, one per
request in flight) and its background work (``spawn``: decode's Aborts, image prefetches).
Shutdown (SIGTERM): ``start_drain`` refuses every request ``admit`` gets from then on with
UNAVAILABLE (HTTP 503) while the ones in flight go on; ``finish_drain`` gives them the drain
budget, then ``end_all`` cancels those still running, each ending with the budget's error as
its terminal item (``cut_off``) and aborted on decode; ``wait_idle`` waits for the aborts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from services.common.errors import StageServeError, UnavailableError

logger = logging.getLogger(__name__)


class RequestTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()  # producers and background work still running
        self._producers: set[asyncio.Task] = set()
        self._is_draining = False
        self._cut_off: StageServeError | None = None

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not ended yet."""
        return len(self._producers)

    @property
    def cut_off(self) -> StageServeError | None:
        """The error ``end_all`` ends the requests in flight with; None before it runs."""
        return self._cut_off

    def admit(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """Start a request's producer, counted in flight until it ends.

        Raises ``UnavailableError`` (and closes ``coro``) once the drain has started.
        """
        if self._is_draining:
            coro.close()
            raise UnavailableError(
                "this router is shutting down and admits no new requests; retry the request "
                "(another router serves it)"
            )
        producer = self.spawn(coro, name)
        self._producers.add(producer)
        producer.add_done_callback(self._producers.discard)
        return producer

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Start a request's background work; ``wait_idle`` waits for it, nothing cancels it."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def start_drain(self) -> None:
        """Refuse every request ``admit`` gets from now on; the ones in flight go on."""
        self._is_draining = True

    async def finish_drain(self, budget_s: float) -> None:
        """Give the requests in flight ``budget_s`` to finish, then end the rest with
        UNAVAILABLE naming the budget."""
        num_in_flight = self.num_in_flight
        logger.info("draining: %d requests in flight, %g s to finish", num_in_flight, budget_s)
        if await self.wait_idle(budget_s):
            return
        logger.warning(
            "drain budget of %g s spent: ending %d requests", budget_s, self.num_in_flight
        )
        self.end_all(
            UnavailableError(
                f"the router shut down before the request finished (its drain budget of "
                f"{budget_s:g} s ran out); retry the request"
            )
        )

    def end_all(self, error: StageServeError) -> None:
        """End every request in flight: each gets ``error`` as its terminal item and is
        aborted on decode (``wait_idle`` then waits for the aborts)."""
        self._cut_off = error
        for producer in list(self._producers):
            producer.cancel()

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: no bound) for every producer and background task
        to end, cancelling none of them; True once there are none."""
        loop = asyncio.get_running_loop()
        deadline_mono = None if timeout_s is None else loop.time() + timeout_s
        while self._tasks:
            remaining_s = None if deadline_mono is None else deadline_mono - loop.time()
            if remaining_s is not None and remaining_s <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=remaining_s)
        return True

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", task.get_name(), exc_info=task.exception())
