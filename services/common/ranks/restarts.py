"""How often and how soon a broken rank group is re-formed: bounded attempts, doubling backoff
(``services.common.restarts``); a group that became ready starts the count again."""

from __future__ import annotations

import math

from services.common.ranks.config import RankGroupConfig
from services.common.restarts import RestartCounter, RestartPolicy


def group_restarts(config: RankGroupConfig) -> RestartCounter:
    """The group's restart counter; ``reset`` when the group becomes ready."""
    policy = RestartPolicy(
        initial_backoff_s=config.restart_backoff_s,
        max_backoff_s=config.max_restart_backoff_s,
        stable_s=math.inf,
        max_attempts=config.max_restart_attempts,
    )
    return RestartCounter(policy)
