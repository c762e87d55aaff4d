"""Which rank of an idle group stopped answering the leader's pings (frozen, wedged).

Every rank answers each ``Ping`` with a ``Pong``. A rank's silence counts only while no
step is in flight (a rank busy in a step reads no ping; the step's deadline governs it):
it runs from the later of the rank's last Pong and the moment the group last went idle
(it became ready, or a step ended). Owned by the supervisor thread.
"""

from __future__ import annotations


class Liveness:
    def __init__(self, num_ranks: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._answered_mono = [0.0] * num_ranks

    def start(self, now: float) -> None:
        """A formation became ready: every rank counts as having answered ``now``."""
        self._answered_mono = [now] * len(self._answered_mono)

    def answered(self, rank: int, now: float) -> None:
        self._answered_mono[rank] = now

    def deadline_mono(self, idle_since_mono: float) -> float:
        """When the quietest rank's silence reaches ``timeout_s`` if none answers before."""
        return max(min(self._answered_mono), idle_since_mono) + self.timeout_s

    def silent(self, now: float, idle_since_mono: float) -> tuple[int, float] | None:
        """The lowest rank silent for ``timeout_s`` by ``now``, idle since ``idle_since_mono``,
        and its silence in seconds; None when every rank answered in time."""
        for rank, answered in enumerate(self._answered_mono):
            silent_s = now - max(answered, idle_since_mono)
            if silent_s >= self.timeout_s:
                return rank, silent_s
        return None
