"""What a step's caller gets, from the ranks' replies: every rank's result, or one error.

``step_outcome`` is a pure function over one step's replies, so the verdict rules live in
one place and are tested without processes; ``InFlight`` is the supervisor's record of the
step the ranks are running (owned by the supervisor thread).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from services.common.errors import StageServeError
from services.common.grpc_errors import _known_classes
from services.common.ranks.errors import StepFailedError
from services.common.ranks.messages import StepReply, StepStatus

logger = logging.getLogger(__name__)

Reply = StepReply | str  # str: why the rank's message for this step was malformed


def agreed_error(error_type: str, text: str) -> StageServeError:
    """The agreed error as the class the failing rank raised (a StageServeError), else StepFailedError."""
    cls = _known_classes().get(error_type) if error_type else None
    return (cls or StepFailedError)(text)


def step_outcome(
    step: int, replies: Sequence[Reply], decoder: msgspec.msgpack.Decoder
) -> list[msgspec.Struct] | StageServeError:
    """Rank-ordered results (decoded with ``decoder``) when every rank answered OK, else the one error.

    Precedence: a malformed reply (lowest rank first), then the agreed failure, which
    every FAILED reply carries identically (a difference is logged: it is a bug).
    """
    for reply in replies:
        if isinstance(reply, str):
            return StepFailedError(reply)
    failed = [r for r in replies if isinstance(r, StepReply) and r.status is StepStatus.FAILED]
    if failed:
        texts = {r.error for r in failed}
        if len(texts) > 1 or len(failed) != len(replies):
            logger.error("step %d: the ranks disagree on the outcome (%s)", step, sorted(texts))
        return agreed_error(failed[0].error_type, failed[0].error)
    results: list[msgspec.Struct] = []
    for rank, reply in enumerate(replies):
        assert isinstance(reply, StepReply) and reply.status is StepStatus.OK
        try:
            results.append(decoder.decode(reply.result))
        except msgspec.DecodeError as exc:
            logger.error("rank %d sent a malformed result for step %d: %s", rank, step, exc)
            return StepFailedError(f"rank {rank} sent a malformed result for step {step}: {exc}")
    return results


@dataclass
class InFlight:
    """The one step the ranks are running: what came back so far, and when it is late."""

    step: int
    num_ranks: int
    timeout_s: float
    deadline_mono: float
    future: Future[list[msgspec.Struct]]
    executed: set[int] = field(default_factory=set)  # ranks done with execute (in the status exchange)
    replies: dict[int, Reply] = field(default_factory=dict)

    def add(self, rank: int, reply: Reply) -> None:
        self.replies.setdefault(rank, reply)

    def is_complete(self) -> bool:
        return len(self.replies) == self.num_ranks

    def resolve(self, decoder: msgspec.msgpack.Decoder) -> None:
        """Hand the caller its outcome; every rank has replied."""
        outcome = step_outcome(self.step, [self.replies[r] for r in range(self.num_ranks)], decoder)
        if isinstance(outcome, list):
            self.future.set_result(outcome)
        else:
            self.future.set_exception(outcome)

    def deadline_reason(self) -> str:
        """Who is late: ranks still executing, else ranks stuck in the status exchange."""
        pending = [r for r in range(self.num_ranks) if r not in self.replies]
        stuck = [r for r in pending if r not in self.executed]
        deadline = f"its {self.timeout_s:.1f} s deadline"
        if stuck:
            return f"{ranks_text(stuck)} did not finish step {self.step} within {deadline}"
        return f"{ranks_text(pending)} did not end the status exchange of step {self.step} within {deadline}"


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
