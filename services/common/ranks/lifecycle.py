"""The rank group's state through its formations: forming one, readiness, fail-stop, re-forms.

Owned by the supervisor thread (``state``, ``rank_pids`` and ``started`` are read elsewhere as
a snapshot); the supervisor's module docstring describes the states.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from services.common.errors import UnavailableError
from services.common.ranks.channel import LeaderChannel
from services.common.ranks.config import RankGroupConfig
from services.common.ranks.errors import RankStartError
from services.common.ranks.formation import Formation
from services.common.ranks.restarts import group_restarts
from services.common.ranks.steps import StepRunner


class GroupState(enum.Enum):
    FORMING = "forming"
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


class Lifecycle:
    def __init__(
        self,
        config: RankGroupConfig,
        steps: StepRunner,
        on_ready_change: Callable[[bool], None],
        log: logging.LoggerAdapter,
    ) -> None:
        self.config = config
        self._steps = steps
        self._on_ready_change = on_ready_change
        self._log = log
        self.started: Future[None] = Future()  # the first formation formed, or could not
        self.state = GroupState.FORMING
        self.rank_pids: tuple[int, ...] = ()
        self.channel: LeaderChannel | None = None  # set by the supervisor once bound
        self.gen: Formation | None = None
        self._num_formations = 0
        self._restarts = group_restarts(config)
        self.restart_at_mono = 0.0
        self._last_error = ""

    def begin_formation(self) -> None:
        assert self.channel is not None
        self._num_formations += 1
        gen = Formation(
            self._num_formations, self.config, time.monotonic() + self.config.start_timeout_s
        )
        self.gen, self.state = gen, GroupState.FORMING
        self._log.info("forming formation %d (%d ranks)", gen.number, self.config.num_ranks)
        try:
            gen.spawn(self.channel.addr)
        except OSError as exc:
            self.formation_failed(f"cannot start the rank processes: {exc}")
            return
        self.rank_pids = gen.pids

    def become_ready(self) -> None:
        assert self.gen is not None
        self.state, self._last_error = GroupState.READY, ""
        self._restarts.reset()
        self._log.info("formation %d is ready", self.gen.number)
        self.notify_ready(True)
        if not self.started.done():
            self.started.set_result(None)

    def formation_failed(self, reason: str) -> None:
        assert self.gen is not None
        self._log.error("formation %d failed to form: %s", self.gen.number, reason)
        self.end_formation()
        if not self.started.done():  # the first start is not retried: its error is the caller's
            self.state, self._last_error = GroupState.FAILED, reason
            self.started.set_exception(RankStartError(f"{self.config.name}: {reason}"))
            return
        self._schedule_restart(reason)

    def fail_stop(self, reason: str, exit_grace_s: float = 0.0) -> None:
        """Readiness off, the formation killed, then the step's caller failed; a re-form
        scheduled."""
        inflight = self._steps.inflight
        step = inflight.step if inflight else None
        exited = self.gen.exit_cause(step, exit_grace_s) if self.gen else None
        reason = exited or reason  # a rank that exited is the likeliest cause: name it
        self._log.error("fail-stop: %s", reason)
        was_ready = self.state is GroupState.READY
        self.state, self._last_error = GroupState.BACKOFF, reason  # not ready before anyone hears
        if was_ready:
            self.notify_ready(False)
        # Every rank is dead and reaped before the caller hears: no write of the step (rows into a
        # peer's memory) can land after the caller has released that memory.
        self.end_formation()
        self._steps.fail(UnavailableError(f"{self.config.name}: {reason}"))
        self._schedule_restart(reason)

    def end_formation(self, grace_s: float = 0.0) -> None:
        assert self.channel is not None
        if self.gen is not None:
            self.gen.end(self.channel, self._steps.last_step, grace_s)
        self.gen, self.rank_pids = None, ()

    def _schedule_restart(self, reason: str) -> None:
        self._last_error = reason
        backoff_s = self._restarts.next_backoff_s()
        if backoff_s is None:
            self.state = GroupState.FAILED
            self._log.error(
                "giving up after %d failed re-forms", self._restarts.policy.max_attempts
            )
            return
        self.state, self.restart_at_mono = GroupState.BACKOFF, time.monotonic() + backoff_s
        self._log.warning(
            "re-forming in %.1f s (attempt %d of %d)",
            backoff_s,
            self._restarts.num_attempts,
            self._restarts.policy.max_attempts,
        )

    def notify_ready(self, is_ready: bool) -> None:
        try:
            self._on_ready_change(is_ready)
        except Exception:  # a callback's bug must not stop the supervisor
            self._log.exception("the readiness callback raised")

    def unready_text(self) -> str:
        name, why = self.config.name, f" after: {self._last_error}" if self._last_error else ""
        if self.state is GroupState.FAILED:
            return f"{name}: the rank group failed for good{why}"
        if not self.started.done():
            return f"{name}: the rank group is still starting"
        return f"{name}: the rank group is re-forming{why}"
