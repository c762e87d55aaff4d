"""The leader's side of a rank group: one thread owns the control socket and the rank processes.

Lifecycle of a formation (one formation of the group):
  FORMING  spawn W ranks; Hello -> Setup (once rank 0 named its TCPStore); Ready from
           every rank -> READY. A StartFailed, a rank's exit or ``start_timeout_s`` fails
           it: the first start raises ``RankStartError``; a re-form counts one attempt.
  READY    one step at a time, in submission order: StepRequest to every rank, replies
           gathered until the step's deadline. Ranks are pinged every ``heartbeat_s`` and
           answer each Ping with a Pong; while no step is in flight, a rank that answered
           none for ``liveness_timeout_s`` (frozen, wedged) is dead (``liveness.py``).
  fail-stop  a rank exited, missed the deadline, broke the status exchange, is
           unreachable or, idle, answered no ping: the step's caller gets
           ``UnavailableError``, readiness goes false, the formation is killed, and after
           a backoff a new one forms: new processes, a new rendezvous. Steps submitted
           meanwhile fail at once.
  BACKOFF -> FORMING; FAILED after ``max_restart_attempts`` consecutive failed re-forms.
  STOPPED  after ``stop``: queued and in-flight steps fail, ranks get Shutdown,
           the ones still running after ``stop_grace_s`` are killed; all are reaped.
Callers hand steps over through a queue (and a wake-up pipe); results go back through
``concurrent.futures.Future``. Everything else here belongs to the supervisor thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq

from services.common.errors import UnavailableError
from services.common.progress import ProgressWatchdog
from services.common.ranks.channel import LeaderChannel, Malformed
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.errors import RankStartError
from services.common.ranks.formation import Formation, Member
from services.common.ranks.handover import Results, StepHandover, Submitted
from services.common.ranks.lifecycle import GroupState, Lifecycle
from services.common.ranks.liveness import Liveness
from services.common.ranks.messages import (
    Hello,
    Ping,
    Pong,
    Ready,
    Shutdown,
    StartFailed,
    StepExecuted,
    StepReply,
    StepStatus,
    ToLeader,
)
from services.common.ranks.steps import StepRunner

logger = logging.getLogger(__name__)


class _Named(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        return f"{self.extra['name']}: {msg}", kwargs  # type: ignore[index]


MAX_POLL_S = 1.0
BROKEN_EXIT_GRACE_S = 0.5  # a BROKEN reply waits this long for a peer's exit to show (named then)
# A rank whose connection is gone has closed it on its way out; its interpreter's teardown can
# take seconds on a loaded host before the exit is reaped: wait that long to name the exit.
GONE_EXIT_GRACE_S = 5.0


class RankGroupSupervisor:
    def __init__(
        self,
        config: RankGroupConfig,
        spec: StepSpec,
        on_ready_change: Callable[[bool], None],
    ) -> None:
        self.config = config
        self.spec = spec
        self.num_ranks = config.num_ranks
        self._log = _Named(logger, {"name": config.name})
        self._thread = threading.Thread(
            target=self._run, name=f"{config.name}-supervisor", daemon=True
        )
        # Ticked for the leader loop (a step sent, a step done) and for each rank (executed,
        # replied).
        self.progress = ProgressWatchdog(
            f"{config.name} leader", config.watchdog_s, self.has_work, is_alive=self._is_alive
        )
        self.rank_progress = tuple(
            ProgressWatchdog(
                f"{config.name} rank {rank}", config.watchdog_s, self.is_step_in_flight
            )
            for rank in range(self.num_ranks)
        )
        self._steps = self._new_steps()
        self._handover = StepHandover()
        self._is_stopping = False
        self._is_finished = False
        self._life = Lifecycle(config, self._steps, on_ready_change, self._log)
        self.started = self._life.started  # the first formation formed, or could not
        # Written by the supervisor thread only; read elsewhere as a snapshot.
        self.control_addr = ""
        self._channel: LeaderChannel | None = None
        self._last_ping_mono = 0.0
        self._liveness = Liveness(self.num_ranks, config.liveness_timeout_s)

    def _new_steps(self) -> StepRunner:
        return StepRunner(self.num_ranks, self.spec.result_type, self.progress, self.rank_progress)

    @property
    def state(self) -> GroupState:
        return self._life.state

    @property
    def rank_pids(self) -> tuple[int, ...]:
        return self._life.rank_pids

    # --- any thread -----------------------------------------------------------------
    def submit(self, payload: msgspec.Raw, timeout_s: float) -> Future[Results]:
        return self._handover.submit(payload, timeout_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (it shuts the ranks down) and wait for it; blocks."""
        self._is_stopping = True
        self._handover.wake()
        if self._thread.ident is not None:  # started: it finishes on its way out
            self._thread.join()
        else:
            self.finish()

    def _is_alive(self) -> bool:
        return self._thread.is_alive() or self._thread.ident is None  # not started is not dead

    def has_work(self) -> bool:
        return self._steps.inflight is not None or not self._handover.is_empty()

    def is_step_in_flight(self) -> bool:
        return self._steps.inflight is not None

    # --- the supervisor thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                self._channel = LeaderChannel(self.config.control_addr, self.config.internal_token)
            except zmq.ZMQError as exc:
                raise RankStartError(
                    f"{self.config.name}: cannot bind {self.config.control_addr}: {exc}"
                ) from exc
            self.control_addr, self._life.channel = self._channel.addr, self._channel
            self._life.begin_formation()
            while not self._is_stopping:
                self._poll_once()
        except BaseException as exc:  # a bug here must still end every caller and every rank
            if not isinstance(exc, RankStartError):
                self._log.exception("the supervisor failed")
            if not self.started.done():
                self.started.set_exception(exc)
        finally:
            self.finish()

    def _poll_once(self) -> None:
        assert self._channel is not None
        poller = zmq.Poller()
        poller.register(self._channel.socket, zmq.POLLIN)
        poller.register(self._handover.wake_fd, zmq.POLLIN)
        gen = self._life.gen
        watched = gen.exit_watch() if gen is not None else {}
        for fd in watched:
            poller.register(fd, zmq.POLLIN)
        timeout_ms = max(0.0, self._next_timer_mono() - time.monotonic()) * 1000
        events = dict(poller.poll(timeout_ms))
        if self._channel.socket in events:
            for peer, message in self._channel.receive_ready():
                self._on_message(peer, message)
        if self._handover.wake_fd in events:
            self._handover.clear_wake()
        for fd, member in watched.items():
            if fd in events and self._life.gen is gen:  # still the same formation
                self._on_exit(member)
        self._on_timers(time.monotonic())
        self._pump()

    def _next_timer_mono(self) -> float:
        timers = [time.monotonic() + MAX_POLL_S]
        gen = self._life.gen
        if self.state is GroupState.FORMING and gen is not None:
            timers.append(gen.next_timer_mono())
        elif self.state is GroupState.BACKOFF:
            timers.append(self._life.restart_at_mono)
        if self._steps.inflight is not None:
            timers.append(self._steps.inflight.deadline_mono)
        elif self.state is GroupState.READY:
            timers.append(self._last_ping_mono + self.config.heartbeat_s)
            timers.append(self._liveness.deadline_mono(self._steps.idle_since_mono))
        return min(timers)

    def _on_timers(self, now: float) -> None:
        gen = self._life.gen
        if self.state is GroupState.FORMING and gen is not None:
            if (failure := gen.forming_failure(now)) is not None:
                self._life.formation_failed(failure)
        elif self.state is GroupState.BACKOFF and now >= self._life.restart_at_mono:
            self._life.begin_formation()
        elif self._steps.inflight is not None and now >= self._steps.inflight.deadline_mono:
            self._life.fail_stop(self._steps.deadline_reason())
        elif self.state is GroupState.READY:
            self._on_ready_timers(now)

    def _on_ready_timers(self, now: float) -> None:
        gen = self._life.gen
        assert gen is not None
        silent = None
        if self._steps.inflight is None:  # a rank busy in a step reads no ping
            silent = self._liveness.silent(now, self._steps.idle_since_mono)
        if silent is not None:
            rank, silent_s = silent
            self._life.fail_stop(f"{gen.members[rank].who} answered no ping for {silent_s:.1f} s")
        elif now >= self._last_ping_mono + self.config.heartbeat_s:
            self._ping(now)

    # --- messages ----------------------------------------------------------------------
    def _on_message(self, peer: bytes, message: ToLeader | Malformed) -> None:
        rank = self._life.gen.rank_of(peer) if self._life.gen is not None else None
        if isinstance(message, Malformed):
            self._on_malformed(rank, message.reason)
        elif isinstance(message, Hello):
            self._on_hello(peer, message)
        elif isinstance(message, StartFailed) and rank in (None, message.rank):
            self._on_start_failed(peer, message)
        elif rank is None:
            self._log.warning("dropped %s from an unknown peer", type(message).__name__)
        elif message.rank != rank:
            self._on_malformed(rank, f"{type(message).__name__} claims rank {message.rank}")
        elif isinstance(message, Ready):
            self._on_ready(rank)
        elif isinstance(message, StepExecuted):
            self._steps.on_executed(rank, message.step)
        elif isinstance(message, StepReply):
            self._on_reply(rank, message)
        elif isinstance(message, Pong):
            self._liveness.answered(rank, time.monotonic())

    def _on_malformed(self, rank: int | None, reason: str) -> None:
        if rank is None:
            self._log.warning("dropped a malformed message from an unknown peer: %s", reason)
            return
        self._log.error("rank %d sent a malformed control message: %s", rank, reason)
        if self.state is GroupState.FORMING:
            self._life.formation_failed(
                f"rank {rank} sent a malformed control message during start-up: {reason}"
            )
        else:
            self._steps.on_malformed(rank, reason)

    def _on_hello(self, peer: bytes, hello: Hello) -> None:
        assert self._channel is not None
        gen = self._life.gen
        if self.state is not GroupState.FORMING or gen is None:
            problem: str | None = f"the group is {self.state.value}, not forming"
        else:
            problem = gen.take_hello(peer, hello)
        if problem is not None:
            self._log.warning(
                "refused the Hello of rank %d (pid %d): %s", hello.rank, hello.pid, problem
            )
            self._channel.send(peer, Shutdown(step=self._steps.last_step))
        elif gen is not None:
            self._send_setups(gen)

    def _send_setups(self, gen: Formation) -> None:
        assert self._channel is not None
        setup = gen.setup(self.spec, self._steps.next_step)
        for member in gen.needing_setup():
            assert member.peer is not None
            if not self._channel.send(member.peer, setup):
                self._life.formation_failed(f"{member.who} is unreachable during start-up")
                return
            member.is_setup_sent = True

    def _on_start_failed(self, peer: bytes, failed: StartFailed) -> None:
        gen = self._life.gen
        failure = gen.start_failure(failed, peer) if gen is not None else None
        if self.state is not GroupState.FORMING or failure is None:
            self._log.warning("stale start failure of rank %d: %s", failed.rank, failed.error)
        else:
            self._life.formation_failed(failure)

    def _on_ready(self, rank: int) -> None:
        if (
            self.state is GroupState.FORMING
            and self._life.gen is not None
            and self._life.gen.mark_ready(rank)
        ):
            self._last_ping_mono = time.monotonic()
            self._liveness.start(self._last_ping_mono)
            self._life.become_ready()

    def _on_reply(self, rank: int, reply: StepReply) -> None:
        if not self._steps.is_current(reply.step):
            self._log.warning(
                "dropped rank %d's reply to step %d (not in flight)", rank, reply.step
            )
        elif reply.status is StepStatus.BROKEN:  # often a peer died: let its exit show, name it
            self._life.fail_stop(reply.error, exit_grace_s=BROKEN_EXIT_GRACE_S)
        else:
            self._steps.on_reply(rank, reply)

    def _on_exit(self, member: Member) -> None:
        member.exited_at_mono = time.monotonic()
        if self.state is GroupState.READY:
            # fail_stop names the exit code and the step
            self._life.fail_stop(f"{member.who} exited")

    # --- steps -------------------------------------------------------------------------
    def _pump(self) -> None:
        while self._steps.inflight is None and (item := self._handover.take()) is not None:
            if self.state is GroupState.READY:
                self._send_step(item)
            else:
                item.future.set_exception(UnavailableError(self._life.unready_text()))

    def _send_step(self, item: Submitted) -> None:
        assert self._channel is not None and self._life.gen is not None
        request = self._steps.begin(item)
        for member in self._life.gen.members:
            assert member.peer is not None
            if not self._channel.send(member.peer, request):
                self._life.fail_stop(
                    f"{member.who} is unreachable at step {request.step}",
                    exit_grace_s=GONE_EXIT_GRACE_S,
                )
                return

    def _ping(self, now: float) -> None:
        assert self._channel is not None and self._life.gen is not None
        self._last_ping_mono = now
        for member in self._life.gen.members:
            assert member.peer is not None
            if not self._channel.send(member.peer, Ping(step=self._steps.last_step)):
                self._life.fail_stop(
                    f"{member.who} is unreachable (its connection is gone)",
                    exit_grace_s=GONE_EXIT_GRACE_S,
                )
                return

    def finish(self) -> None:
        """Fail every step, shut the ranks down (kill after the grace), release everything;
        idempotent."""
        if self._is_finished:
            return
        self._is_finished = True
        was_ready = self.state is GroupState.READY
        self._life.state = GroupState.STOPPED
        stopped = UnavailableError(f"{self.config.name}: the rank group is stopped")
        self._handover.close(stopped)
        if self._channel is not None:  # the ranks end before the step's caller hears (fail_stop)
            self._life.end_formation(self.config.stop_grace_s)
            self._channel.close()
        self._steps.fail(stopped)
        if was_ready:
            self._life.notify_ready(False)
        if not self.started.done():
            self.started.set_exception(
                RankStartError(f"{self.config.name}: stopped before the group formed")
            )
