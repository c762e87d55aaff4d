"""The encoder's readiness: SERVING while at least one rank serves and no service-wide watchdog
holds it.

Each rank is a rank group of its own and reports its readiness (formed and warmed up, or
fail-stopped and re-forming) from its own thread; ``ReadinessGate.set_rank_ready`` takes it
on the event loop. Each progress watchdog talks to its own ``view(rank)`` as if it were the
health state: a stall takes that watchdog's hold, progress gives it back. A view of a rank
(its group's watchdogs) holds that rank only; a view of no rank (the batch loop's) holds the
service. A rank serves while its group is ready and none of its views holds; the service is
SERVING while some rank serves and no service-wide view holds. So a watchdog that recovers
while its rank re-forms does not report that rank serving too early. Call everything from
the event loop.
"""

from __future__ import annotations

from services.common.server import HealthState


class ReadinessGate:
    def __init__(self, health: HealthState, num_ranks: int) -> None:
        assert num_ranks > 0
        self.health = health
        self._is_rank_ready = [False] * num_ranks
        self._holders: dict[int, int | None] = {}  # holding view -> its rank (None: service-wide)
        self._num_views = 0

    def set_rank_ready(self, rank: int, is_ready: bool) -> None:
        self._is_rank_ready[rank] = is_ready
        self._apply()

    def view(self, rank: int | None = None) -> WatchdogView:
        """A health-state stand-in for one progress watchdog (``ProgressWatchdog.check``) of
        ``rank``, or of the whole service (None)."""
        assert rank is None or 0 <= rank < len(self._is_rank_ready)
        self._num_views += 1
        return WatchdogView(self, self._num_views, rank)

    def hold(self, view: WatchdogView, is_holding: bool) -> None:
        if is_holding:
            self._holders[view.view_id] = view.rank
        else:
            self._holders.pop(view.view_id, None)
        self._apply()

    def is_rank_serving(self, rank: int) -> bool:
        held = set(self._holders.values())
        return self._is_rank_ready[rank] and rank not in held

    def _apply(self) -> None:
        is_held = None in self._holders.values()
        is_any_serving = any(self.is_rank_serving(r) for r in range(len(self._is_rank_ready)))
        self.health.set_serving(is_any_serving and not is_held)


class WatchdogView:
    """What ``ProgressWatchdog.check`` reads and sets, routed through the gate."""

    def __init__(self, gate: ReadinessGate, view_id: int, rank: int | None) -> None:
        self._gate = gate
        self.view_id = view_id
        self.rank = rank

    @property
    def is_shutting_down(self) -> bool:
        return self._gate.health.is_shutting_down

    @property
    def is_serving(self) -> bool:
        """Whether what this view watches serves: its rank, or the service."""
        if self.rank is None:
            return self._gate.health.is_serving
        return self._gate.is_rank_serving(self.rank)

    def set_serving(self, is_serving: bool) -> None:
        self._gate.hold(self, not is_serving)
