"""What a step's caller gets, from the ranks' replies: every rank's result, or one error.

``step_outcome`` is a pure function over one step's replies, so the verdict rules live in
one place and are tested without processes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from services.common.errors import ErrorRecord, StageServeError
from services.common.ranks.errors import StepFailedError
from services.common.ranks.messages import StepReply, StepStatus

logger = logging.getLogger(__name__)

Reply = StepReply | str  # str: why the rank's message for this step was malformed


def agreed_error(error_type: str, text: str) -> StageServeError:
    """The agreed error as the class the failing rank raised (a StageServeError), else
    StepFailedError."""
    return ErrorRecord(error_type, text).to_error(StepFailedError)


def step_outcome(
    step: int, replies: Sequence[Reply], decoder: msgspec.msgpack.Decoder
) -> list[msgspec.Struct] | StageServeError:
    """Rank-ordered results (decoded with ``decoder``) when every rank answered OK, else the one
    error.

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


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
