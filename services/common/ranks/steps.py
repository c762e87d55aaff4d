"""The leader's step sequence: step numbers, the one step in flight, its caller's outcome.

Steps run one at a time in submission order. ``begin`` numbers a step and returns the
request every rank gets; replies (or a rank's malformed message, which stands for its
reply) are collected until every rank has answered, then the caller's future is resolved
(``outcome.step_outcome``). A deadline or fail-stop ends the step with ``fail`` instead.
Owned by the supervisor thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from services.common.errors import StageServeError
from services.common.progress import ProgressWatchdog
from services.common.ranks.handover import Results, Submitted
from services.common.ranks.messages import StepReply, StepRequest
from services.common.ranks.outcome import Reply, ranks_text, step_outcome

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    step: int
    timeout_s: float
    deadline_mono: float
    future: Future[Results]
    executed: set[int] = field(
        default_factory=set
    )  # ranks done with execute (in the status exchange)
    replies: dict[int, Reply] = field(default_factory=dict)


class StepRunner:
    def __init__(
        self,
        num_ranks: int,
        result_type: type[msgspec.Struct],
        progress: ProgressWatchdog,
        rank_progress: Sequence[ProgressWatchdog],
    ) -> None:
        self.num_ranks = num_ranks
        self._decoder = msgspec.msgpack.Decoder(result_type)
        self._progress = progress  # ticks when a step is sent and when it ends
        self._rank_progress = tuple(
            rank_progress
        )  # ticks when the rank executed and when it replied
        self.next_step = 1  # numbers go on across formations
        self.inflight: InFlight | None = None
        self.idle_since_mono = 0.0  # when the last step ended

    @property
    def last_step(self) -> int:
        return self.next_step - 1

    def begin(self, item: Submitted) -> StepRequest:
        assert self.inflight is None, "one step at a time"
        step = self.next_step
        self.next_step += 1
        self.inflight = InFlight(
            step, item.timeout_s, time.monotonic() + item.timeout_s, item.future
        )
        self._progress.tick()
        return StepRequest(step=step, timeout_s=item.timeout_s, payload=item.payload)

    def is_current(self, step: int) -> bool:
        return self.inflight is not None and self.inflight.step == step

    def on_executed(self, rank: int, step: int) -> None:
        if self.inflight is not None and self.is_current(step):
            self.inflight.executed.add(rank)
            self._rank_progress[rank].tick()

    def on_reply(self, rank: int, reply: StepReply) -> None:
        """A current step's reply (FAILED or OK; BROKEN is the supervisor's to act on)."""
        assert self.inflight is not None and self.is_current(reply.step)
        self._rank_progress[rank].tick()
        self._add(rank, reply)

    def on_malformed(self, rank: int, reason: str) -> None:
        """A rank's malformed message stands for its reply to the step in flight, if it has none
        yet."""
        if self.inflight is not None and rank not in self.inflight.replies:
            step = self.inflight.step
            self._add(
                rank, f"rank {rank} sent a malformed control message during step {step}: {reason}"
            )

    def fail(self, error: StageServeError) -> None:
        """End the step in flight, if any, with ``error``."""
        if self.inflight is not None:
            inflight, self.inflight = self.inflight, None
            self.idle_since_mono = time.monotonic()
            inflight.future.set_exception(error)

    def deadline_reason(self) -> str:
        """Who is late: ranks still executing, else ranks stuck in the status exchange."""
        inflight = self.inflight
        assert inflight is not None
        pending = [r for r in range(self.num_ranks) if r not in inflight.replies]
        stuck = [r for r in pending if r not in inflight.executed]
        limit = f"its {inflight.timeout_s:.1f} s deadline"
        if stuck:
            return f"{ranks_text(stuck)} did not finish step {inflight.step} within {limit}"
        return (
            f"{ranks_text(pending)} did not end the status exchange of step {inflight.step} "
            f"within {limit}"
        )

    def _add(self, rank: int, reply: Reply) -> None:
        inflight = self.inflight
        assert inflight is not None
        inflight.replies.setdefault(rank, reply)
        if len(inflight.replies) < self.num_ranks:
            return
        self.inflight, self.idle_since_mono = None, time.monotonic()
        self._progress.tick()
        outcome = step_outcome(
            inflight.step, [inflight.replies[r] for r in range(self.num_ranks)], self._decoder
        )
        if isinstance(outcome, list):
            inflight.future.set_result(outcome)
        else:
            inflight.future.set_exception(outcome)
