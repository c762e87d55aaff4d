"""How often and how soon a broken rank group is re-formed: bounded attempts, doubling backoff."""

from __future__ import annotations

from services.common.ranks.config import RankGroupConfig


class RestartPolicy:
    """Counts consecutive failed formations; a group that became ready starts the count again."""

    def __init__(self, config: RankGroupConfig) -> None:
        self.max_attempts = config.max_restart_attempts
        self.base_s = config.restart_backoff_s
        self.max_s = config.max_restart_backoff_s
        self.num_attempts = 0

    def next_backoff_s(self) -> float | None:
        """Count one more attempt; its backoff, or None once the attempts are spent."""
        self.num_attempts += 1
        if self.num_attempts > self.max_attempts:
            return None
        return min(self.base_s * 2 ** (self.num_attempts - 1), self.max_s)

    def reset(self) -> None:
        self.num_attempts = 0
