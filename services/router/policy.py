"""Routing policies: which ready worker of a kind gets the next request."""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence

from services.router.config import PolicyName
from services.router.workers import Worker, WorkerKind


class BaseRoutingPolicy(abc.ABC):
    @abc.abstractmethod
    def choose(self, kind: WorkerKind, candidates: Sequence[Worker]) -> Worker:
        """Pick one of ``candidates`` (ready workers of ``kind``, in configured order, never empty)."""


class RoundRobinPolicy(BaseRoutingPolicy):
    """Each kind cycles through its ready workers in turn."""

    def __init__(self) -> None:
        self._turns: dict[WorkerKind, itertools.count] = {}

    def _turn(self, kind: WorkerKind) -> int:
        return next(self._turns.setdefault(kind, itertools.count()))

    def choose(self, kind: WorkerKind, candidates: Sequence[Worker]) -> Worker:
        assert candidates, "choose needs a candidate"
        return candidates[self._turn(kind) % len(candidates)]


class LeastLoadPolicy(RoundRobinPolicy):
    """The worker with the fewest requests in flight from this router; ties go round-robin."""

    def choose(self, kind: WorkerKind, candidates: Sequence[Worker]) -> Worker:
        assert candidates, "choose needs a candidate"
        least = min(w.num_in_flight for w in candidates)
        tied = [w for w in candidates if w.num_in_flight == least]
        return tied[self._turn(kind) % len(tied)]


def make_policy(name: PolicyName) -> BaseRoutingPolicy:
    return {PolicyName.ROUND_ROBIN: RoundRobinPolicy, PolicyName.LEAST_LOAD: LeastLoadPolicy}[
        name
    ]()
