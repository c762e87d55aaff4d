"""Restarts ``stageserve up``'s children that exit after start-up.

A watched child moves RUNNING -> (exits) WAITING -> (its delay passed) STARTING ->
(READY line) RUNNING; a restart that exits or misses the ready timeout while STARTING
goes back to WAITING with a longer delay. The launcher keeps the processes; this module
only decides when to restart them.
"""

from __future__ import annotations

import enum
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from services.launcher import Child, Launcher


class WatchState(enum.Enum):
    RUNNING = "running"  # ready; an exit schedules a restart
    WAITING = "waiting"  # exited; restarts at ``restart_at``
    STARTING = "starting"  # restarted; waiting for its READY line


@dataclass
class _Watch:
    backoff_s: float
    since: float  # when ``state`` was entered
    state: WatchState = WatchState.RUNNING
    restart_at: float = 0.0
    num_restarts: int = 0


class Supervisor:
    """Restarts the launcher's children when they exit after start-up.

    Call ``poll`` from the main thread (it spawns processes) until ``stop`` is set; no
    restart starts once it is. Lines go to ``out``: the exit and the delay, then
    ``<name> is ready again (pid N)``. A restart that exits or misses ``ready_timeout_s``
    before its READY line counts as another exit (the delay keeps growing).
    """

    def __init__(
        self,
        launcher: Launcher,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ) -> None:
        self._launcher = launcher
        self._policy = launcher.cfg.restart
        self._stop = stop
        self._clock = clock
        self._out = out
        now = clock()
        self._watches = {
            c.name: _Watch(self._policy.initial_backoff_s, now) for c in launcher.children
        }

    def _say(self, line: str) -> None:
        print(line, file=self._out if self._out is not None else sys.stderr, flush=True)

    def poll(self) -> None:
        for child in list(self._launcher.children):
            if self._stop.is_set():
                return
            self._step(child, self._watches[child.name], self._clock())

    def _step(self, child: Child, watch: _Watch, now: float) -> None:
        code = child.process.poll()
        if watch.state is WatchState.RUNNING:
            if code is not None:
                up_s = now - watch.since
                self._schedule(
                    child.name, watch, now, f"exited with code {code}", up_s=up_s, code=code
                )
        elif watch.state is WatchState.WAITING:
            if now >= watch.restart_at:
                self._launcher.restart(child)
                watch.state, watch.since = WatchState.STARTING, now
        elif child.ready:
            watch.state, watch.since = WatchState.RUNNING, now
            self._launcher.write_state()
            self._say(f"{child.name} is ready again (pid {child.process.pid})")
        elif code is not None:
            self._schedule(
                child.name, watch, now, f"exited with code {code} before it was ready", code=code
            )
        elif now - watch.since > self._launcher.cfg.ready_timeout_s:
            self._launcher.kill(child)
            timeout_s = self._launcher.cfg.ready_timeout_s
            self._schedule(
                child.name, watch, now, f"was not ready after {timeout_s:.0f} s (killed)"
            )

    def _schedule(
        self, name: str, watch: _Watch, now: float, what: str, up_s: float = 0.0, code: int = 0
    ) -> None:
        """``code`` > 0: the child exited by itself, so its log says why (printed after the
        line)."""
        if up_s >= self._policy.stable_s:
            watch.backoff_s = self._policy.initial_backoff_s
        delay_s = watch.backoff_s
        watch.backoff_s = min(delay_s * 2, self._policy.max_backoff_s)
        watch.num_restarts += 1
        watch.state, watch.restart_at, watch.since = WatchState.WAITING, now + delay_s, now
        why = self._launcher.log_hint(name) + self._launcher.why(name) if code > 0 else ""
        self._say(
            f"{name} {what}; restarting in {delay_s:.1f} s (restart {watch.num_restarts}){why}"
        )
