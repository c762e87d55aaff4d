"""The loops of a free-running rank group: rank 0 steps by itself and reports each step to the
leader unsolicited; ranks 1.. (followers) run what rank 0 tells them.

Rank 0 (``FreeRankLoop``), per iteration: drain the inbox (without blocking while there is a
step to run; else waiting at most ``POLL_S`` or until the step class's timer is due), answer
Pings, collect Posts, then run one step with the posts' payloads and send its ``Report`` (OK
with the result, or FAILED after ``on_failed``; the rank goes on). A step runs once after
warm-up (the leader learns the rank's state), whenever posts came, while ``has_work()``, once
the timer is due, and once after a failed step. A malformed message counts as a post: its
step fails. There is no status exchange: the step class owns whatever its followers do.

A follower (``FollowerLoop``), per iteration: answer Pings, then ``follow(FOLLOW_S)`` (rank
0's next piece of work, if it comes in time). It gets no Post and sends no Report; when
``follow`` raises it leaves BROKEN, and the leader re-forms the whole group.

Both loops leave on Shutdown and when their parent is gone or the leader has been silent for
``leader_timeout_s`` (``LeaderWatch``; it pings every rank every heartbeat, busy or not);
rank 0 also leaves when ``on_failed`` raises (the leader re-forms the group). The step watchdog
ends the process when a step (or a follower's piece of work) runs ``STUCK_EXIT_GRACE_S`` past
``Setup.step_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from services.common.errors import StageServeError
from services.common.ranks.channel import Malformed, RankChannel
from services.common.ranks.messages import (
    NIL,
    Ping,
    Pong,
    Post,
    Report,
    Setup,
    Shutdown,
    StepStatus,
    ToRank,
    cut,
    encode_raw,
    error_text,
)
from services.common.ranks.rank_loop import POLL_S, LeaderWatch, LoopExit, StepWatchdog
from services.common.ranks.step import FreeRankStep

logger = logging.getLogger(__name__)
FOLLOW_S = 0.05  # a follower's wait for rank 0's work: the bound on its answer to a Ping


class LeaderInbox:
    """A free-running rank's end of the control channel: every Ping answered with a Pong as it
    is read, and the leader's silence watched (``LeaderWatch``)."""

    def __init__(self, channel: RankChannel, rank: int, setup: Setup, parent_pid: int) -> None:
        self.channel = channel
        self.rank = rank
        self._leader = LeaderWatch(parent_pid, setup.leader_timeout_s, time.monotonic())

    def drain(self, wait_s: float) -> list[ToRank | Malformed]:
        """Every message waiting but Pings (the first awaited at most ``wait_s``)."""
        messages = []
        message = self.channel.receive(wait_s)
        if message is not None:
            self._leader.heard(time.monotonic())
        while message is not None:
            if isinstance(message, Ping):
                self.channel.send(Pong(step=message.step, rank=self.rank))
            else:
                messages.append(message)
            message = self.channel.receive(0)
        return messages

    def is_orphaned(self) -> bool:
        return self._leader.is_gone(time.monotonic())


class FreeRankLoop:
    def __init__(
        self,
        channel: RankChannel,
        step_fn: FreeRankStep,
        rank: int,
        setup: Setup,
        parent_pid: int,
    ) -> None:
        assert setup.is_free_running and setup.step_timeout_s > 0
        self.channel = channel
        self.step_fn = step_fn
        self.rank = rank
        self.setup = setup
        self.parent_pid = parent_pid  # the leader; 0: none (a loop driven in-process)
        self._decoder = msgspec.msgpack.Decoder(type(step_fn).payload_type)
        self._next_step = setup.first_step
        self._num_posts = 0  # Posts (and malformed messages) read in this process
        self._payloads: list[Any] = []
        self._malformed: list[str] = []
        self._is_step_due = True  # the first report, and the one after a failed step

    def serve(self) -> LoopExit:
        watchdog = StepWatchdog()
        inbox = LeaderInbox(self.channel, self.rank, self.setup, self.parent_pid)
        while True:
            for message in inbox.drain(self._wait_s()):
                if isinstance(message, Shutdown):
                    logger.info("shutdown after step %d", self._next_step - 1)
                    return LoopExit.SHUTDOWN
                self._take(message)
            if not self._has_step():
                if inbox.is_orphaned():
                    return LoopExit.ORPHANED
                continue
            watchdog.arm(time.monotonic() + self.setup.step_timeout_s)
            report = self.run_step()
            watchdog.disarm()
            if report is None:
                return LoopExit.BROKEN
            self.channel.send(report)

    def _wait_s(self) -> float:
        if self._has_step():
            return 0.0
        return min(POLL_S, max(self.step_fn.seconds_until_due(), 0.0))

    def _has_step(self) -> bool:
        return bool(
            self._is_step_due
            or self._payloads
            or self._malformed
            or self.step_fn.has_work()
            or self.step_fn.seconds_until_due() <= 0
        )

    def _take(self, message: ToRank | Malformed) -> None:
        if isinstance(message, Post):
            self._num_posts += 1
            try:
                self._payloads.append(self._decoder.decode(message.payload))
            except msgspec.DecodeError as exc:
                self._malformed.append(f"malformed post {message.seq}: {exc}")
        elif isinstance(message, Malformed):
            self._num_posts += 1
            self._malformed.append(f"malformed control message: {message.reason}")
        else:
            logger.error("ignored %s from the leader (a bug)", type(message).__name__)

    def run_step(self) -> Report | None:
        """One step with what was posted; its report, or None when ``on_failed`` raised."""
        step, payloads, malformed = self._next_step, self._payloads, self._malformed
        self._next_step, self._payloads, self._malformed = step + 1, [], []
        self._is_step_due = False
        if malformed:
            logger.error("step %d: %s", step, malformed[0])
            return self._failed(step, f"from the leader: {'; '.join(malformed)}")
        try:
            result = self.step_fn.run_step(step, payloads)
        except Exception as exc:  # the step's failure: reported, the rank goes on
            logger.exception("step %d failed", step)
            error_type = type(exc).__name__ if isinstance(exc, StageServeError) else ""
            return self._failed(step, error_text(exc), error_type)
        cls = type(self.step_fn)
        if not isinstance(result, cls.result_type):
            expected = cls.result_type.__name__
            return self._failed(step, f"run_step returned {type(result).__name__}, not {expected}")
        try:
            raw = encode_raw(result)
        except (TypeError, msgspec.EncodeError) as exc:
            return self._failed(step, f"result does not encode: {error_text(exc)}")
        return self._report(step, StepStatus.OK, raw)

    def _failed(self, step: int, error: str, error_type: str = "") -> Report | None:
        try:
            self.step_fn.on_failed(step, error)
        except Exception:
            logger.exception("on_failed(%d) raised: leaving", step)
            return None
        self._is_step_due = True  # the leader learns the state the failure left
        return self._report(step, StepStatus.FAILED, NIL, cut(error), error_type)

    def _report(
        self, step: int, status: StepStatus, result: msgspec.Raw, error: str = "", kind: str = ""
    ) -> Report:
        return Report(
            step=step,
            rank=self.rank,
            num_posts=self._num_posts,
            status=status,
            has_work=self._has_step(),
            result=result,
            error=error,
            error_type=kind,
        )


class FollowerLoop:
    """Rank > 0 of a free-running group: it runs rank 0's work (``FreeRankStep.follow``)."""

    def __init__(
        self,
        channel: RankChannel,
        step_fn: FreeRankStep,
        rank: int,
        setup: Setup,
        parent_pid: int,
    ) -> None:
        assert setup.is_free_running and setup.step_timeout_s > 0 and rank > 0
        self.channel = channel
        self.step_fn = step_fn
        self.rank = rank
        self.setup = setup
        self.parent_pid = parent_pid  # the leader; 0: none (a loop driven in-process)

    def serve(self) -> LoopExit:
        watchdog = StepWatchdog()
        inbox = LeaderInbox(self.channel, self.rank, self.setup, self.parent_pid)
        while True:
            for message in inbox.drain(0):
                if isinstance(message, Shutdown):
                    logger.info("shutdown (a follower of rank 0)")
                    return LoopExit.SHUTDOWN
                what = (
                    f"a malformed message ({message.reason})"
                    if isinstance(message, Malformed)
                    else type(message).__name__
                )
                logger.error("a follower ignored %s from the leader (a bug)", what)
            if inbox.is_orphaned():
                return LoopExit.ORPHANED
            watchdog.arm(time.monotonic() + FOLLOW_S + self.setup.step_timeout_s)
            try:
                self.step_fn.follow(FOLLOW_S)
            except Exception:  # this rank cannot go on in rank 0's steps: the group re-forms
                logger.exception("follow raised: leaving")
                return LoopExit.BROKEN
            finally:
                watchdog.disarm()
