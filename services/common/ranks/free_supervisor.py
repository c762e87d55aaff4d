"""The leader's side of a free-running rank group (``RankGroupConfig.is_free_running``).

Rank 0 steps by itself (``free_loop.py``); ranks 1.. follow it (they run its collectives, told
by rank 0 what to run) and send no Report. ``post`` numbers a payload (``seq``) and the
supervisor thread sends it to rank 0 at once; every ``Report`` rank 0 sends goes to
``on_report`` as a ``Reported``: the posts it covers and the step's result or error.
Supervision is the stepped group's (``supervisor.py``: exit watch, fail-stop, re-form with
backoff, Ping/Pong to every rank), with the step deadline replaced: while the group has work
(posts rank 0 has not reported, or its last report said it has more), a group whose rank 0
sends no report for ``step_timeout_s`` hangs: fail-stop. The followers are held to that too,
through rank 0's reports (busy in rank 0's steps, they may answer no ping). Idle, a rank that
answers no ping for ``liveness_timeout_s`` is dead, as in a stepped group. A malformed message
from a rank (a Report from a follower included) is a fail-stop too. A fail-stop kills and
re-forms every rank. At a fail-stop, once every rank is dead and reaped, every post sent is
reported lost (``Reported.is_down``); a post made while the group does not serve is reported
lost at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from services.common.errors import StageServeError, UnavailableError
from services.common.progress import ProgressWatchdog
from services.common.ranks.channel import Malformed
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.lifecycle import GroupState
from services.common.ranks.messages import Post, Report, StepStatus, ToLeader
from services.common.ranks.outcome import agreed_error
from services.common.ranks.steps import StepRunner
from services.common.ranks.supervisor import MAX_POLL_S, RankGroupSupervisor


@dataclass(frozen=True)
class Reported:
    """What reached the leader for its posts up to ``through_seq``: a step's ``result``, the
    step's ``error`` (the rank goes on), or the rank's loss (``is_down``: those posts are lost,
    and so is whatever the rank held)."""

    through_seq: int  # 0: no post
    result: msgspec.Struct | None = None
    error: StageServeError | None = None
    is_down: bool = False


OnReport = Callable[[Reported], None]
logger = logging.getLogger(__name__)


def _emit(on_report: OnReport, reported: Reported) -> None:
    try:
        on_report(reported)
    except Exception:  # a callback's bug must not stop the supervisor
        logger.exception("the report callback raised")


class FreeSteps(StepRunner):
    """The posts sent to rank 0 of the current formation and its reports; supervisor thread."""

    def __init__(
        self,
        result_type: type[msgspec.Struct],
        progress: ProgressWatchdog,
        rank_progress: Sequence[ProgressWatchdog],
        on_report: OnReport,
    ) -> None:
        super().__init__(1, result_type, progress, rank_progress)
        self._on_report = on_report
        self._unreported: deque[int] = deque()  # seqs sent to this formation, not yet covered
        self._num_reported = 0  # posts of this formation covered by a report
        self._last_covered = 0  # the seq of the last of them (0: none)
        self._reported_work = False
        self.last_heard_mono = 0.0  # the last report, or the post that ended an idle spell

    @property
    def has_work(self) -> bool:
        return bool(self._unreported) or self._reported_work

    def begin_formation(self, now: float) -> None:
        """A formation became ready: its first step comes unasked."""
        self._unreported, self._num_reported, self._last_covered = deque(), 0, 0
        self._reported_work, self.last_heard_mono = True, now

    def sent(self, seq: int, now: float) -> None:
        if not self.has_work:
            self.last_heard_mono = now
        self._unreported.append(seq)
        self._progress.tick()

    def on_report(self, report: Report, now: float) -> str | None:
        """Hand ``report`` out; or why it is malformed (nothing handed out)."""
        num_covered = report.num_posts - self._num_reported
        if not 0 <= num_covered <= len(self._unreported):
            num_sent = self._num_reported + len(self._unreported)
            return f"report of step {report.step} covers {report.num_posts} posts of {num_sent}"
        result, error = None, None
        if report.status is StepStatus.OK:
            try:
                result = self._decoder.decode(report.result)
            except msgspec.DecodeError as exc:
                return f"malformed result of step {report.step}: {exc}"
        else:
            error = agreed_error(report.error_type, report.error)
        for _ in range(num_covered):
            self._last_covered = self._unreported.popleft()
        self._num_reported, self._reported_work = report.num_posts, report.has_work
        self.last_heard_mono, self.next_step = now, report.step + 1
        if not self.has_work:
            self.idle_since_mono = now
        self._progress.tick()
        for progress in self._rank_progress:  # the followers' progress is rank 0's steps
            progress.tick()
        _emit(self._on_report, Reported(self._last_covered, result, error))
        return None

    def fail(self, error: StageServeError) -> None:
        """The group is gone (dead and reaped) or stops: every post sent is lost."""
        through = self._unreported[-1] if self._unreported else self._last_covered
        self._unreported, self._reported_work = deque(), False
        self.idle_since_mono = time.monotonic()
        _emit(self._on_report, Reported(through, error=error, is_down=True))


class FreeRankSupervisor(RankGroupSupervisor):
    def __init__(
        self,
        config: RankGroupConfig,
        spec: StepSpec,
        on_ready_change: Callable[[bool], None],
        on_report: OnReport,
    ) -> None:
        assert config.is_free_running
        self._on_report = on_report
        super().__init__(config, spec, on_ready_change)
        self._free = self._steps
        assert isinstance(self._free, FreeSteps)
        self._posts: deque[tuple[int, msgspec.Raw]] = deque()
        self._seqs = itertools.count(1)
        self._post_lock = threading.Lock()  # orders post against finish
        # (formation, peer, report) of rank 0's reports before its followers' Ready
        self._early: list[tuple[object, bytes, Report]] = []

    def _new_steps(self) -> StepRunner:
        return FreeSteps(self.spec.result_type, self.progress, self.rank_progress, self._on_report)

    # --- any thread -----------------------------------------------------------------
    def post(self, payload: msgspec.Raw) -> int:
        """Send ``payload`` to rank 0 (a ``Reported`` covers it later); its ``seq``."""
        with self._post_lock:
            seq = next(self._seqs)
            if not self._is_finished:
                self._posts.append((seq, payload))
                self._handover.wake()
                return seq
        stopped = UnavailableError(f"{self.config.name}: the rank group is stopped")
        _emit(self._on_report, Reported(seq, error=stopped, is_down=True))
        return seq

    def has_work(self) -> bool:
        return bool(self._posts) or self._free.has_work

    def is_step_in_flight(self) -> bool:
        return self._free.has_work

    # --- the supervisor thread --------------------------------------------------------
    def _pump(self) -> None:
        while self._posts:
            seq, payload = self._posts.popleft()
            gen = self._life.gen
            if self.state is not GroupState.READY or gen is None:
                unready = UnavailableError(self._life.unready_text())
                _emit(self._on_report, Reported(seq, error=unready, is_down=True))
                continue
            assert self._channel is not None and gen.members[0].peer is not None
            self._free.sent(seq, time.monotonic())
            if not self._channel.send(gen.members[0].peer, Post(seq=seq, payload=payload)):
                self._life.fail_stop(f"{gen.members[0].who} is unreachable at post {seq}")

    def _next_timer_mono(self) -> float:
        if self.state is not GroupState.READY:
            return super()._next_timer_mono()
        timers = [time.monotonic() + MAX_POLL_S, self._last_ping_mono + self.config.heartbeat_s]
        if self._free.has_work:
            timers.append(self._free.last_heard_mono + self.config.step_timeout_s)
        else:
            timers.append(self._liveness.deadline_mono(self._free.idle_since_mono))
        return min(timers)

    def _on_ready_timers(self, now: float) -> None:
        gen = self._life.gen
        assert gen is not None
        silent_s = now - self._free.last_heard_mono
        if self._free.has_work and silent_s >= self.config.step_timeout_s:
            who = gen.members[0].who
            self._life.fail_stop(f"{who} has work and sent no report for {silent_s:.1f} s")
            return
        # While the group has work, its followers are busy in rank 0's steps: its reports rule.
        silent = (
            None if self._free.has_work else self._liveness.silent(now, self._free.idle_since_mono)
        )
        if silent is not None:
            rank, silent_s = silent
            self._life.fail_stop(f"{gen.members[rank].who} answered no ping for {silent_s:.1f} s")
        elif now >= self._last_ping_mono + self.config.heartbeat_s:
            self._ping(now)

    def _on_message(self, peer: bytes, message: ToLeader | Malformed) -> None:
        if not isinstance(message, Report):
            super()._on_message(peer, message)
            return
        gen = self._life.gen
        rank = gen.rank_of(peer) if gen is not None else None
        if rank is not None and self.state is GroupState.FORMING:
            # rank 0 was Ready and stepped before its followers' Ready came: held for READY
            self._early.append((gen, peer, message))
        elif rank is None or self.state is not GroupState.READY:
            self._log.warning("dropped a report from a peer not serving (step %d)", message.step)
        elif message.rank != rank:
            self._on_malformed(rank, f"Report claims rank {message.rank}")
        elif rank != 0:
            self._on_malformed(rank, f"a follower sent a Report (of step {message.step})")
        elif (problem := self._free.on_report(message, time.monotonic())) is not None:
            self._on_malformed(rank, problem)

    def _on_malformed(self, rank: int | None, reason: str) -> None:
        if rank is None or self.state is not GroupState.READY:
            super()._on_malformed(rank, reason)
            return
        self._log.error("rank %d sent a malformed control message: %s", rank, reason)
        self._life.fail_stop(f"rank {rank} sent a malformed control message: {reason}")

    def _on_ready(self, rank: int) -> None:
        if self.state is GroupState.FORMING:
            self._free.begin_formation(time.monotonic())
        super()._on_ready(rank)
        if self.state is GroupState.READY:
            early, self._early = self._early, []
            for gen, peer, report in early:
                if gen is self._life.gen:  # reports of a formation that failed are dropped
                    self._on_message(peer, report)

    def finish(self) -> None:
        super().finish()
        with self._post_lock:
            posts, self._posts = list(self._posts), deque()
        stopped = UnavailableError(f"{self.config.name}: the rank group is stopped")
        for seq, _ in posts:
            _emit(self._on_report, Reported(seq, error=stopped, is_down=True))
