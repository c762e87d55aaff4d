"""Restarts ``stageserve up``'s children that exit or stop answering after start-up.

A watched child moves RUNNING -> (exits, or is killed for not answering) WAITING -> (its
delay passed) STARTING -> (READY line) RUNNING; a restart that exits or misses the ready
timeout while STARTING goes back to WAITING with a longer delay. The launcher keeps the
processes; this module only decides when to restart them.

Liveness: every ``interval_s`` of the launch config's ``LivenessPolicy`` each RUNNING child
gets a gRPC health ``Check`` of ``liveness`` (on a thread, deadline ``interval_s``; the
main-thread loop only looks at finished checks). A child whose checks all failed for
``timeout_s``, the latest one included, is stopped or hung (SIGSTOP, a blocked event loop):
it is killed (SIGKILL) and restarted on its ports like a child that exited.
"""

from __future__ import annotations

import concurrent.futures
import enum
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TextIO

from services.common.healthcheck import is_serving
from services.common.restarts import RestartCounter
from services.common.server import LIVENESS_SERVICE

if TYPE_CHECKING:
    import subprocess

    from services.launch_spec import LaunchConfig

Probe = Callable[[str, float], bool]  # (address, deadline in s) -> answered


def check_liveness(address: str, timeout_s: float) -> bool:
    return is_serving(address, LIVENESS_SERVICE, timeout_s=timeout_s)


class WatchedChild(Protocol):
    """What the supervisor reads of one child process (``services.launcher.Child``)."""

    @property
    def name(self) -> str: ...

    @property
    def process(self) -> subprocess.Popen: ...

    @property
    def ready(self) -> dict[str, str]: ...  # its READY line's fields; empty until it printed one

    @property
    def address(self) -> str: ...


class ChildHost(Protocol):
    """What the supervisor asks of the launcher (``services.launcher.Launcher``)."""

    @property
    def cfg(self) -> LaunchConfig: ...

    @property
    def children(self) -> list[WatchedChild]: ...

    def kill(self, child: WatchedChild) -> None: ...

    def restart(self, old: WatchedChild) -> WatchedChild: ...

    def write_state(self) -> None: ...

    def log_hint(self, name: str) -> str: ...

    def why(self, name: str) -> str: ...


class WatchState(enum.Enum):
    RUNNING = "running"  # ready; an exit schedules a restart
    WAITING = "waiting"  # exited; restarts at ``restart_at``
    STARTING = "starting"  # restarted; waiting for its READY line


@dataclass
class _Watch:
    restarts: RestartCounter
    since: float  # when ``state`` was entered
    state: WatchState = WatchState.RUNNING
    restart_at: float = 0.0
    num_restarts: int = 0
    answered_at: float = 0.0  # when the latest answered liveness check was sent
    check: concurrent.futures.Future[bool] | None = None  # the liveness check in flight
    check_sent_at: float = float("-inf")
    missed: bool = False  # the latest finished check got no answer

    def enter_running(self, now: float) -> None:
        self.state, self.since, self.answered_at = WatchState.RUNNING, now, now
        self.check, self.missed = None, False


class ChildSupervisor:
    """Restarts the launcher's children when they exit after start-up.

    Call ``poll`` from the main thread (it spawns processes) until ``stop`` is set; no
    restart starts once it is. Lines go to ``out``: the exit (or the silence) and the delay,
    then ``<name> is ready again (pid N)``. A restart that exits or misses ``ready_timeout_s``
    before its READY line counts as another exit (the delay keeps growing). ``probe`` runs
    on ``executor``'s threads (default: one thread per child); ``close`` stops them.
    """

    def __init__(
        self,
        launcher: ChildHost,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
        probe: Probe = check_liveness,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._launcher = launcher
        self._policy = launcher.cfg.restart
        self._liveness = launcher.cfg.liveness
        self._stop = stop
        self._clock = clock
        self._out = out
        self._probe = probe
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max(1, len(launcher.children)), thread_name_prefix="liveness"
        )
        now = clock()
        self._watches = {
            c.name: _Watch(RestartCounter(self._policy), now, answered_at=now)
            for c in launcher.children
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _say(self, line: str) -> None:
        print(line, file=self._out if self._out is not None else sys.stderr, flush=True)

    def poll(self) -> None:
        for child in list(self._launcher.children):
            if self._stop.is_set():
                return
            self._step(child, self._watches[child.name], self._clock())

    def _step(self, child: WatchedChild, watch: _Watch, now: float) -> None:
        code = child.process.poll()
        if watch.state is WatchState.RUNNING:
            if code is not None:
                up_s = now - watch.since
                self._schedule(
                    child.name, watch, now, f"exited with code {code}", up_s=up_s, code=code
                )
            elif not self._is_live(child, watch, now):
                self._launcher.kill(child)
                silent_s = now - watch.answered_at
                self._schedule(
                    child.name,
                    watch,
                    now,
                    f"(pid {child.process.pid}) answered no liveness check for {silent_s:.1f} s "
                    "(killed)",
                    up_s=now - watch.since,
                )
        elif watch.state is WatchState.WAITING:
            if now >= watch.restart_at:
                self._launcher.restart(child)
                watch.state, watch.since = WatchState.STARTING, now
        elif child.ready:
            watch.enter_running(now)
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

    def _is_live(self, child: WatchedChild, watch: _Watch, now: float) -> bool:
        """False once every check of the last ``timeout_s`` failed, the latest one included
        (one still in flight twice its deadline after it was sent failed); sends the next check
        when one is due."""
        check, interval_s = watch.check, self._liveness.interval_s
        if check is not None and check.done():
            watch.check = None
            watch.missed = check.exception() is not None or not check.result()
            if not watch.missed:
                watch.answered_at = max(watch.answered_at, watch.check_sent_at)
        elif check is not None and now - watch.check_sent_at > 2 * interval_s:
            watch.check, watch.missed = None, True
        if watch.missed and now - watch.answered_at >= self._liveness.timeout_s:
            return False
        if watch.check is None and now - watch.check_sent_at >= interval_s:
            watch.check_sent_at = now
            watch.check = self._executor.submit(self._probe, child.address, interval_s)
        return True

    def _schedule(
        self, name: str, watch: _Watch, now: float, what: str, up_s: float = 0.0, code: int = 0
    ) -> None:
        """``code`` > 0: the child exited by itself, so its log says why (printed after the
        line)."""
        delay_s = watch.restarts.next_backoff_s(up_s)
        assert delay_s is not None, "up's children restart without bound"
        watch.num_restarts += 1
        watch.state, watch.restart_at, watch.since = WatchState.WAITING, now + delay_s, now
        why = self._launcher.log_hint(name) + self._launcher.why(name) if code > 0 else ""
        self._say(
            f"{name} {what}; restarting in {delay_s:.1f} s (restart {watch.num_restarts}){why}"
        )
