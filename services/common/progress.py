"""Progress watchdog: readiness follows a service's scheduler loop.

The loop calls ``tick()`` whenever it makes progress (takes a plan, finishes a step).
``run(health)`` polls: while work is pending and no tick came within ``stall_s`` (or the
loop is dead), the loop is stalled and the service is reported NOT_SERVING; when ticks
resume it is SERVING again. The watchdog only takes back the readiness it took away: it
never reports SERVING for a service that was not ready, and does nothing once shutdown
has begun.

Idle time is not a stall: while no work is pending the stall clock keeps restarting, so
work that arrives after a quiet hour gets a full ``stall_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import Gauge

from services.common.server import HealthState

logger = logging.getLogger(__name__)
POLL_S = 1.0


def _always() -> bool:
    return True


class ProgressWatchdog:
    """Decides whether a loop is stuck; ``tick`` and the queries are lock-free and thread-safe.

    ``work_pending``: whether the loop has work it should be progressing on.
    ``is_alive``: whether the loop still runs at all (a dead loop is stalled for good).
    ``may_serve``: whether the service's owner would serve now: while it says no (a rank group
    re-forming), a stall that ends lets go of readiness without giving it back, and the owner
    sets SERVING itself once it is ready.
    ``stalled_gauge``: set to 1 while ``run`` finds the loop stalled, else 0.
    """

    def __init__(
        self,
        name: str,
        stall_s: float,
        work_pending: Callable[[], bool],
        *,
        is_alive: Callable[[], bool] = _always,
        may_serve: Callable[[], bool] = _always,
        clock: Callable[[], float] = time.monotonic,
        stalled_gauge: Gauge | None = None,
    ) -> None:
        assert stall_s > 0
        self.name = name
        self.stall_s = stall_s
        self._work_pending = work_pending
        self._is_alive = is_alive
        self._may_serve = may_serve
        self._clock = clock
        self._stalled_gauge = stalled_gauge
        self._last_tick_s = clock()  # written by the loop's thread only
        self._last_idle_s = self._last_tick_s  # written by the callers of is_stalled only
        self._is_holding_readiness = False
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> None:
        """The loop made progress."""
        self._last_tick_s = self._clock()

    def is_stalled(self) -> bool:
        """Dead, or work pending and neither a tick nor an idle moment within ``stall_s``."""
        if not self._is_alive():
            return True
        now = self._clock()
        if not self._work_pending():
            self._last_idle_s = now
            return False
        return now - max(self._last_tick_s, self._last_idle_s) > self.stall_s

    def is_healthy(self) -> bool:
        return not self.is_stalled()

    def check(self, health: HealthState) -> None:
        """Apply the verdict once: take readiness away while stalled, give it back after."""
        if health.is_shutting_down:
            return
        is_stalled = self.is_stalled()
        if self._stalled_gauge is not None:
            self._stalled_gauge.set(int(is_stalled))
        if is_stalled and health.is_serving:
            logger.warning(
                "%s loop is stuck or dead (no progress for %.1f s): NOT_SERVING",
                self.name,
                self.stall_s,
            )
            self._is_holding_readiness = True
            health.set_serving(False)
        elif not is_stalled and self._is_holding_readiness:
            self._is_holding_readiness = False
            if not self._may_serve():
                logger.warning("%s loop makes progress again; its owner is not ready", self.name)
                return
            logger.warning("%s loop makes progress again: SERVING", self.name)
            health.set_serving(True)

    async def run(self, health: HealthState, interval_s: float = POLL_S) -> None:
        """``check`` every ``interval_s`` until shutdown begins."""
        while not health.is_shutting_down:
            self.check(health)
            await asyncio.sleep(interval_s)

    def start(self, health: HealthState, interval_s: float = POLL_S) -> None:
        """Run ``run(health)`` as a task of the running event loop until ``stop``."""
        assert self._task is None, "start the watchdog once"
        self._task = asyncio.get_running_loop().create_task(
            self.run(health, interval_s), name=f"{self.name}-watchdog"
        )

    def stop(self) -> None:
        """Cancel the ``run`` task started by ``start``; from any thread."""
        if self._task is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
