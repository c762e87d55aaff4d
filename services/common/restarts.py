"""One restart-with-backoff policy for whatever restarts a process: ``stageserve up``'s
children (``services.supervisor``) and a service's rank group (``services.common.ranks``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """Delay before a restart: ``initial_backoff_s``, doubling per consecutive failure up to
    ``max_backoff_s``. A process that stayed up ``stable_s`` starts the count again; after
    ``max_attempts`` consecutive failures (None: no bound) there is no further restart."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_s: float = 30.0
    max_attempts: int | None = None

    def backoff_s(self, attempt: int) -> float | None:
        """The delay before consecutive attempt ``attempt`` (from 1); None once spent."""
        if self.max_attempts is not None and attempt > self.max_attempts:
            return None
        return min(self.initial_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class RestartCounter:
    """Counts the consecutive failed starts of one process (or group) under a policy."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_attempts = 0

    def next_backoff_s(self, up_s: float = 0.0) -> float | None:
        """Count one more attempt after a run of ``up_s`` (at least ``stable_s``: the count
        starts again); its backoff, or None once the attempts are spent."""
        if up_s >= self.policy.stable_s:
            self.num_attempts = 0
        self.num_attempts += 1
        return self.policy.backoff_s(self.num_attempts)

    def reset(self) -> None:
        self.num_attempts = 0
