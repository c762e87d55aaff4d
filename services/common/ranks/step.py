"""What a rank runs: a ``BaseRankStep`` subclass, named by import path, built in the rank process.

Contract, per rank process and in this order: ``__init__(ctx, init)`` builds the rank's
state (model, cache) from the leader's ``init`` struct; ``warmup()`` runs once before the
group reports ready; then ``execute(step, payload)`` once per step, in step order; after a
step the ranks agreed failed, ``on_failed(step, error)`` lets each rank drop what that step
left behind; ``close()`` at exit. Payloads, results and the init are msgspec structs of the
class's ``payload_type``, ``result_type`` and ``init_type``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class RankContext:
    """This rank's place in the group and its process groups (formed before ``__init__``;
    None in a free-running group of one, which runs no collective)."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:N", already the current device
    cpu_group: ProcessGroup | None  # gloo: CPU collectives (manifests, the step's own agreement)
    device_group: ProcessGroup | None  # tensors: NCCL on CUDA ranks, gloo on CPU ranks
    collective_timeout_s: float  # both groups' timeout
    host: str = "127.0.0.1"  # the address this rank's gloo groups listen on (``rank_main --host``)
    joined: bool = False  # started on another host (``stageserve join-rank``): ``host`` is its own


class BaseRankStep(abc.ABC):
    """One rank's step function; subclasses set the three struct types."""

    init_type: ClassVar[type[msgspec.Struct]]
    payload_type: ClassVar[type[msgspec.Struct]]
    result_type: ClassVar[type[msgspec.Struct]]

    @abc.abstractmethod
    def __init__(self, ctx: RankContext, init: Any) -> None:
        """Build this rank's state; an exception fails the group's start, naming this rank."""

    def warmup(self) -> None:  # noqa: B027 (a hook: most steps need no warm-up)
        """Compile, capture, run one forward of each kind: after it the first step is as fast as
        any."""

    @abc.abstractmethod
    def execute(self, step: int, payload: Any) -> msgspec.Struct:
        """Run one step; return a ``result_type`` struct or raise (the step then fails on every
        rank)."""

    def on_failed(self, step: int, error: str) -> None:  # noqa: B027 (a hook)
        """The ranks agreed that ``step`` failed with ``error`` (the same text on every rank)."""

    def close(self) -> None:  # noqa: B027 (a hook)
        """Release what ``__init__`` took; called once at exit."""


class FreeRankStep(BaseRankStep):
    """A rank group that steps by itself (``RankGroupConfig.is_free_running``; ``free_loop.py``).

    Rank 0's loop calls ``run_step(step, payloads)`` with the payloads posted since its previous
    step (in order; maybe none) once after warm-up, then whenever posts came, while
    ``has_work()``, and once ``seconds_until_due()`` has run out; each result goes to the
    leader. After a step that raised, ``on_failed`` runs and a step without posts follows.
    In a group of several, ranks 1.. are followers: their loop calls only ``follow`` (and
    ``warmup``, ``close``); rank 0 tells them what to run, through the class's own channel.
    """

    @abc.abstractmethod
    def run_step(self, step: int, payloads: list[Any]) -> msgspec.Struct:
        """Apply ``payloads`` and run one step; return a ``result_type`` struct or raise."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether the next step should run at once, with no post."""

    def seconds_until_due(self) -> float:
        """How long an idle rank may wait before a step is due by itself (a timer)."""
        return math.inf

    def follow(self, timeout_s: float) -> None:
        """A follower (rank > 0 of a free-running group): wait at most ``timeout_s`` for rank 0's
        next piece of work and run it; return after running it or on timeout. Raising ends the
        rank (the leader then re-forms the whole group)."""
        raise NotImplementedError(f"{type(self).__name__} runs in a free-running group of one")

    def execute(self, step: int, payload: Any) -> msgspec.Struct:
        return self.run_step(step, [payload])
