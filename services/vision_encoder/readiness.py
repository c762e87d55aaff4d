"""The encoder's readiness: SERVING iff its rank group is ready and no progress watchdog holds it.

The rank group reports its readiness (formed and warmed up, or fail-stopped and
re-forming) from its own thread; ``ReadinessGate.set_group_ready`` takes it on the event
loop. Each progress watchdog talks to its own ``view()`` as if it were the health state:
a stall takes that watchdog's hold, progress gives it back, and the service is SERVING
only while the group is ready and nobody holds. So a watchdog that recovers while the
group re-forms does not report SERVING too early. Call everything from the event loop.
"""

from __future__ import annotations

from services.common.server import HealthState


class ReadinessGate:
    def __init__(self, health: HealthState) -> None:
        self.health = health
        self._is_group_ready = False
        self._holders: set[int] = set()  # views holding readiness back
        self._num_views = 0

    def set_group_ready(self, is_ready: bool) -> None:
        self._is_group_ready = is_ready
        self._apply()

    def view(self) -> WatchdogView:
        """A health-state stand-in for one progress watchdog (``ProgressWatchdog.check``)."""
        self._num_views += 1
        return WatchdogView(self, self._num_views)

    def hold(self, view_id: int, is_holding: bool) -> None:
        if is_holding:
            self._holders.add(view_id)
        else:
            self._holders.discard(view_id)
        self._apply()

    def _apply(self) -> None:
        self.health.set_serving(self._is_group_ready and not self._holders)


class WatchdogView:
    """What ``ProgressWatchdog.check`` reads and sets, routed through the gate."""

    def __init__(self, gate: ReadinessGate, view_id: int) -> None:
        self._gate = gate
        self._view_id = view_id

    @property
    def is_shutting_down(self) -> bool:
        return self._gate.health.is_shutting_down

    @property
    def is_serving(self) -> bool:
        return self._gate.health.is_serving

    def set_serving(self, is_serving: bool) -> None:
        self._gate.hold(self._view_id, not is_serving)
