"""``RankGroup``: what a model service's leader holds to run steps on its R rank processes.

Use: ``group = RankGroup(config, spec, on_ready_change=...)``; ``await group.start()``
(forms the group: every rank spawned, its step class built and warmed up; raises
``RankStartError`` naming the rank and cause); ``await group.step(payload)`` (every rank's
result in rank order, or the step's one error); ``group.stop()`` at shutdown. A
free-running group (one rank that steps by itself, ``free_supervisor.py``) takes
``post(payload)`` instead of steps and hands each of the rank's reports to ``on_report``.

Errors a step raises: the agreed error (``StepFailedError``, or the ``StageServeError``
class the failing rank raised; the group serves on), ``UnavailableError`` when the group
fail-stops (a rank died, hung past the deadline, or could not agree) or is re-forming,
stopped or failed for good. ``on_ready_change(bool)`` is called from the group's thread
whenever readiness changes (a service maps it to SERVING / NOT_SERVING on its loop).
The leader imports no torch and touches no device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.free_supervisor import FreeRankSupervisor, OnReport
from services.common.ranks.handover import Results
from services.common.ranks.lifecycle import GroupState
from services.common.ranks.messages import encode_raw
from services.common.ranks.supervisor import RankGroupSupervisor


def _ignore(is_ready: bool) -> None:
    return None


class RankGroup:
    """Thread-safe; ``step`` never blocks the event loop (the group's own thread does the
    waiting)."""

    def __init__(
        self,
        config: RankGroupConfig,
        spec: StepSpec,
        *,
        on_ready_change: Callable[[bool], None] = _ignore,
        on_report: OnReport | None = None,
    ) -> None:
        """``on_report``: a free-running group's (and only its) report callback, called from
        the group's thread."""
        if config.is_free_running is (on_report is None):
            raise ValueError("on_report is for a free-running group, and it needs one")
        self.config = config
        self.num_ranks = config.num_ranks
        self._supervisor: RankGroupSupervisor = (
            FreeRankSupervisor(config, spec, on_ready_change, on_report)
            if on_report is not None
            else RankGroupSupervisor(config, spec, on_ready_change)
        )
        self.progress = (
            self._supervisor.progress
        )  # the leader loop: ticks when a step is sent and done
        self.rank_progress = (
            self._supervisor.rank_progress
        )  # each rank: ticks when it executed, replied
        self._is_started = False

    @property
    def state(self) -> GroupState:
        return self._supervisor.state

    @property
    def is_ready(self) -> bool:
        return self._supervisor.state is GroupState.READY

    @property
    def control_addr(self) -> str:
        """The bound control address (set once ``start`` has begun binding)."""
        return self._supervisor.control_addr

    @property
    def rank_pids(self) -> tuple[int, ...]:
        """The current formation's rank processes, in rank order; () between formations."""
        return self._supervisor.rank_pids

    async def start(self) -> None:
        """Form the first formation; on failure stop everything and raise ``RankStartError``."""
        assert not self._is_started, "start a rank group once"
        self._is_started = True
        self._supervisor.start()
        try:
            await asyncio.wrap_future(self._supervisor.started)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise

    def submit(self, payload: msgspec.Struct, timeout_s: float | None = None) -> Future[Results]:
        """Queue one step for every rank; the future holds every rank's result (rank order) or the
        error."""
        if not isinstance(payload, msgspec.Struct):
            raise TypeError(f"a step payload is a msgspec.Struct, got {type(payload).__name__}")
        if self.config.is_free_running:
            raise TypeError(f"{self.config.name} runs free: post to it, it steps by itself")
        timeout_s = self.config.step_timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"a step's timeout_s must be > 0, got {timeout_s}")
        return self._supervisor.submit(encode_raw(payload), timeout_s)

    def post(self, payload: msgspec.Struct) -> int:
        """A free-running group: send ``payload`` to its rank; its seq (``Reported``)."""
        if not isinstance(self._supervisor, FreeRankSupervisor):
            raise TypeError(f"{self.config.name} is stepped: submit steps to it")
        return self._supervisor.post(encode_raw(payload))

    async def step(self, payload: msgspec.Struct, timeout_s: float | None = None) -> Results:
        """``submit`` and await its results; cancelling the wait drops a step that has not
        started."""
        return await asyncio.wrap_future(self.submit(payload, timeout_s))

    def stop(self) -> None:
        """Fail pending steps, shut the ranks down (SIGKILL after ``stop_grace_s``), reap;
        blocks."""
        self.progress.stop()
        for watchdog in self.rank_progress:
            watchdog.stop()
        self._supervisor.stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.stop)
