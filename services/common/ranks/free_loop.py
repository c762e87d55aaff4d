"""A free-running rank's loop: it steps by itself and reports each step to the leader unsolicited.

The serve mode of a world of one (``RankGroupConfig.is_free_running``). Per iteration:
drain the inbox (without blocking while there is a step to run; else waiting at most
``POLL_S`` or until the step class's timer is due), answer Pings, collect Posts, then run
one step with the posts' payloads and send its ``Report`` (OK with the result, or FAILED
after ``on_failed``; the rank goes on). A step runs once after warm-up (the leader learns
the rank's state), whenever posts came, while ``has_work()``, once the timer is due, and
once after a failed step. A malformed message counts as a post: its step fails. There is
no status exchange: no peer could take part in one.

The loop leaves on Shutdown, when its parent is gone or the leader has been silent for
``leader_timeout_s`` (``LeaderWatch``; it pings this rank every heartbeat, busy or not), and when
``on_failed`` raises (the leader restarts the rank); the step watchdog ends the process
when a step runs ``STUCK_EXIT_GRACE_S`` past ``Setup.step_timeout_s``.
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
        leader = LeaderWatch(self.parent_pid, self.setup.leader_timeout_s, time.monotonic())
        while True:
            messages = self._drain(self._wait_s())
            if messages:
                leader.heard(time.monotonic())
            for message in messages:
                if isinstance(message, Shutdown):
                    logger.info("shutdown after step %d", self._next_step - 1)
                    return LoopExit.SHUTDOWN
                self._take(message)
            if not self._has_step():
                if leader.is_gone(time.monotonic()):
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

    def _drain(self, wait_s: float) -> list[ToRank | Malformed]:
        messages = []
        message = self.channel.receive(wait_s)
        while message is not None:
            messages.append(message)
            message = self.channel.receive(0)
        return messages

    def _take(self, message: ToRank | Malformed) -> None:
        if isinstance(message, Ping):
            self.channel.send(Pong(step=message.step, rank=self.rank))
        elif isinstance(message, Post):
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
