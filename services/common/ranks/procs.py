"""Spawned rank processes: start one, watch its exit (a pidfd the leader polls), kill and reap it.

The leader signals only the pids it started, and reaps each one, so nothing outlives
the group: ``stop_all`` waits for the exits it asked for and kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.envs import INTERNAL_TOKEN_ENV

logger = logging.getLogger(__name__)
REAP_TIMEOUT_S = 10.0  # a SIGKILLed process is gone long before this


@dataclass(frozen=True)
class RankLaunch:
    """Everything a spawned rank process is started with (its command line)."""

    control_addr: str
    formation: int
    rank: int
    world_size: int
    device: str
    rendezvous_timeout_s: float
    module: str  # run as ``python -m``: RankGroupConfig.rank_module
    host: str = "127.0.0.1"  # where rank 0's store and the rank's gloo device listen
    internal_token: str = ""  # the group's; the rank's Hello carries it (environment, never argv)

    def environment(self) -> dict[str, str]:
        """Ours, with the group's internal token (not whatever token this process inherited)."""
        env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_ENV}
        if self.internal_token:
            env[INTERNAL_TOKEN_ENV] = self.internal_token
        return env

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            self.module,
            "--leader",
            self.control_addr,
            "--formation",
            str(self.formation),
            "--rank",
            str(self.rank),
            "--world-size",
            str(self.world_size),
            "--device",
            self.device,
            "--parent-pid",
            str(os.getpid()),
            "--rendezvous-timeout-s",
            str(self.rendezvous_timeout_s),
            "--host",
            self.host,
        ]


class RankProcess:
    """One spawned rank; ``exit_fd`` becomes readable when it exits."""

    def __init__(self, launch: RankLaunch) -> None:
        self.rank = launch.rank
        self.device = launch.device
        self._popen = subprocess.Popen(
            launch.argv(), stdin=subprocess.DEVNULL, close_fds=True, env=launch.environment()
        )
        self.pid = self._popen.pid
        self.exit_fd = os.pidfd_open(self.pid)

    def exit_code(self) -> int | None:
        """None while it runs; negative: killed by that signal."""
        return self._popen.poll()

    def kill(self) -> None:
        """SIGKILL (works on a stopped process too), if it still runs."""
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited just now
                signal.pidfd_send_signal(self.exit_fd, signal.SIGKILL)

    def reap(self, timeout_s: float = REAP_TIMEOUT_S) -> None:
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.error(
                "rank %d (pid %d) did not exit %.0f s after SIGKILL", self.rank, self.pid, timeout_s
            )
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1


def stop_all(processes: Sequence[RankProcess], grace_s: float) -> None:
    """Wait up to ``grace_s`` for every process to exit by itself, then SIGKILL the rest; reap
    all."""
    deadline_mono = time.monotonic() + grace_s
    for process in processes:
        while process.exit_code() is None and time.monotonic() < deadline_mono:
            time.sleep(0.02)
    kill_all(processes)


def kill_all(processes: Sequence[RankProcess]) -> None:
    """SIGKILL every process still running, then reap all."""
    for process in processes:
        process.kill()
    for process in processes:
        process.reap()
