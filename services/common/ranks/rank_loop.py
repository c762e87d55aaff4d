"""A rank's step loop: answer each StepRequest with one StepReply, in step order.

Per step: decode the payload, ``execute`` it, tell the leader ``StepExecuted``, all-gather the
ranks' statuses (``agreement.exchange``) before the step's deadline (a group of one rank has
none to gather: its own status is the agreed one), and reply with the verdict every rank
reached: OK with this rank's result, or FAILED with the agreed error
(after ``on_failed``). A malformed message where a step was due counts as that step,
failed on this rank. An exchange that cannot complete (a peer dead or stuck, a desync)
makes this rank reply BROKEN and leave: the group is restarted as a whole.

The loop also leaves when the leader says Shutdown, and when its parent (the leader) is gone
or has been silent for ``leader_timeout_s`` (``LeaderWatch``, the free-running loop's too; the
leader pings idle ranks, each Ping answered with a Pong: its check that this rank is alive). A step
still running ``STUCK_EXIT_GRACE_S`` past its deadline (the leader has given up on it)
ends the process from a watchdog thread, should the leader not have killed it yet.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from services.common.errors import StageServeError
from services.common.ranks.agreement import agree, exchange
from services.common.ranks.channel import Malformed, RankChannel
from services.common.ranks.messages import (
    NIL,
    Ping,
    Pong,
    RankStatus,
    Setup,
    Shutdown,
    StepExecuted,
    StepReply,
    StepRequest,
    StepStatus,
    cut,
    encode_raw,
    error_text,
)
from services.common.ranks.step import BaseRankStep

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)
POLL_S = 0.5  # how often an idle rank checks on its leader, and the watchdog on a step
STUCK_EXIT_GRACE_S = 2.0


class LoopExit(enum.IntEnum):
    """The rank process's exit code."""

    SHUTDOWN = 0
    BROKEN = 1  # also: start-up failed
    ORPHANED = 2
    STUCK = 3


class StepWatchdog:
    """Ends the process when an armed deadline is ``STUCK_EXIT_GRACE_S`` behind."""

    def __init__(self) -> None:
        self._deadline_mono: float | None = None  # written by the step loop only
        threading.Thread(target=self._run, name="rank-step-watchdog", daemon=True).start()

    def arm(self, deadline_mono: float) -> None:
        self._deadline_mono = deadline_mono

    def disarm(self) -> None:
        self._deadline_mono = None

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            deadline_mono = self._deadline_mono
            if deadline_mono is not None and time.monotonic() > deadline_mono + STUCK_EXIT_GRACE_S:
                logger.critical(
                    "a step is %.1f s past its deadline: exiting", time.monotonic() - deadline_mono
                )
                sys.stderr.flush()
                os._exit(LoopExit.STUCK)


class LeaderWatch:
    """Whether the leader is gone: this process's parent is no longer ``parent_pid`` (0: none
    to check, a loop driven in-process), or nothing came from it for ``leader_timeout_s``."""

    def __init__(self, parent_pid: int, leader_timeout_s: float, now_mono: float) -> None:
        self._parent_pid = parent_pid
        self._timeout_s = leader_timeout_s
        self._heard_mono = now_mono

    def heard(self, now_mono: float) -> None:
        self._heard_mono = now_mono

    def is_gone(self, now_mono: float) -> bool:
        """True (and logged) once the leader is gone; this rank should then exit ORPHANED."""
        if self._parent_pid and os.getppid() != self._parent_pid:
            logger.error("the leader (pid %d) is gone: exiting", self._parent_pid)
            return True
        silent_s = now_mono - self._heard_mono
        if silent_s > self._timeout_s:
            logger.error("no word from the leader for %.1f s: exiting", silent_s)
            return True
        return False


class RankLoop:
    def __init__(
        self,
        channel: RankChannel,
        step_fn: BaseRankStep,
        control_group: ProcessGroup,
        rank: int,
        setup: Setup,
        parent_pid: int,
    ) -> None:
        self.channel = channel
        self.step_fn = step_fn
        self.control_group = control_group  # the status exchange's own group (the default one)
        self._is_alone = control_group.size() == 1
        self.rank = rank
        self.setup = setup
        self.parent_pid = parent_pid  # the leader; 0: none (a loop driven in-process)
        self._next_step = setup.first_step

    def serve(self) -> LoopExit:
        watchdog = StepWatchdog()
        leader = LeaderWatch(self.parent_pid, self.setup.leader_timeout_s, time.monotonic())
        while True:
            message = self.channel.receive(POLL_S)
            now = time.monotonic()
            if message is None:
                if leader.is_gone(now):
                    return LoopExit.ORPHANED
                continue
            leader.heard(now)
            if isinstance(message, Shutdown):
                logger.info("shutdown after step %d", message.step)
                return LoopExit.SHUTDOWN
            if isinstance(message, Ping):
                self.channel.send(Pong(step=message.step, rank=self.rank))
                continue
            if isinstance(message, Setup):
                logger.error("ignored a second Setup from the leader (a bug)")
                continue
            timeout_s = (
                message.timeout_s
                if isinstance(message, StepRequest)
                else self.setup.collective_timeout_s
            )
            watchdog.arm(now + timeout_s)
            reply = self.run_step(message)
            self.channel.send(reply)
            watchdog.disarm()
            leader.heard(time.monotonic())  # the leader does not ping a rank busy with its step
            if reply.status is StepStatus.BROKEN:
                logger.error("leaving the group: %s", reply.error)
                return LoopExit.BROKEN

    def run_step(self, message: StepRequest | Malformed) -> StepReply:
        start_s = time.monotonic()
        if isinstance(message, Malformed):  # it stood where the next step was due
            step, timeout_s = self._next_step, self.setup.collective_timeout_s
            logger.error(
                "malformed control message where step %d was due: %s", step, message.reason
            )
            status, result = self._failed(
                step, f"malformed control message from the leader: {message.reason}"
            )
        else:
            step, timeout_s = message.step, message.timeout_s
            status, result = self._execute(step, message.payload)
        self._next_step = step + 1
        self.channel.send(StepExecuted(step=step, rank=self.rank))
        try:
            remaining_s = start_s + timeout_s - time.monotonic()
            statuses = (
                [status] if self._is_alone else exchange(self.control_group, status, remaining_s)
            )
            agreed = agree(statuses, step)
        except Exception as exc:  # a timeout, a lost peer, a desync: no verdict is possible
            cause = f"rank {self.rank}: status exchange of step {step} failed: {error_text(exc)}"
            return StepReply(step=step, rank=self.rank, status=StepStatus.BROKEN, error=cause)
        if agreed is None:
            return StepReply(step=step, rank=self.rank, status=StepStatus.OK, result=result)
        try:
            self.step_fn.on_failed(step, agreed.error)
        except Exception as exc:
            logger.exception("on_failed(%d) raised", step)
            cause = f"rank {self.rank}: on_failed of step {step} raised {error_text(exc)}"
            return StepReply(step=step, rank=self.rank, status=StepStatus.BROKEN, error=cause)
        return StepReply(
            step=step,
            rank=self.rank,
            status=StepStatus.FAILED,
            error=agreed.error,
            error_type=agreed.error_type,
        )

    def _execute(self, step: int, raw: msgspec.Raw) -> tuple[RankStatus, msgspec.Raw]:
        cls = type(self.step_fn)
        try:
            payload = msgspec.msgpack.decode(raw, type=cls.payload_type)
        except msgspec.DecodeError as exc:
            logger.error("step %d: malformed payload: %s", step, exc)
            return self._failed(step, f"malformed step payload: {exc}")
        try:
            result = self.step_fn.execute(step, payload)
        except Exception as exc:  # the step's failure, agreed on below; the rank goes on
            logger.exception("step %d failed", step)
            error_type = type(exc).__name__ if isinstance(exc, StageServeError) else ""
            return self._failed(step, error_text(exc), error_type)
        if not isinstance(result, cls.result_type):
            expected = cls.result_type.__name__
            return self._failed(
                step, f"execute returned {type(result).__name__}, expected {expected}"
            )
        try:
            return RankStatus(step=step, rank=self.rank, is_ok=True), encode_raw(result)
        except (TypeError, msgspec.EncodeError) as exc:
            return self._failed(step, f"result does not encode: {error_text(exc)}")

    def _failed(
        self, step: int, error: str, error_type: str = ""
    ) -> tuple[RankStatus, msgspec.Raw]:
        return RankStatus(
            step=step, rank=self.rank, is_ok=False, error=cut(error), error_type=error_type
        ), NIL
