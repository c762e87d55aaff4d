"""The decode leader's drain (SIGTERM): from ``run`` on, every Reserve is refused
(UNAVAILABLE) while the live requests (reserved and generating) go on to their end, up to the
drain's budget; the leader's stop then fails those left, its error naming the spent budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.common.errors import UnavailableError
from services.decode.routes import Routes

logger = logging.getLogger(__name__)


class Drain:
    """Whether the decode worker drains, and the budget it was given once it does."""

    def __init__(self) -> None:
        self._budget_s: float | None = None  # set when the drain starts

    def check_admits(self) -> None:
        """Raise ``UnavailableError`` once the drain has started: no new Reserve."""
        if self._budget_s is not None:
            raise UnavailableError("this decode worker is shutting down and takes no new requests")

    async def run(self, routes: Routes, budget_s: float) -> None:
        """Refuse from now on; return once ``routes`` is empty or ``budget_s`` is spent."""
        self._budget_s = budget_s
        logger.info("draining: %d requests live, %g s to finish", len(routes), budget_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(routes.wait_empty(), budget_s)
        if routes:
            num_left = len(routes)
            logger.warning("drain budget of %g s spent: failing %d requests", budget_s, num_left)

    def stop_reason(self) -> str:
        """Why the stop fails the requests still live: the shutdown, and the drain's budget."""
        reason = "decode is shutting down"
        if self._budget_s is not None:
            reason += f" (its drain budget of {self._budget_s:g} s ran out)"
        return reason
