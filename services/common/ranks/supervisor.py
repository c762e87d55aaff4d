"""The leader's side of a rank group: one thread owns the control socket and the rank processes.

Lifecycle of a generation (one formation of the group):
  FORMING  spawn W ranks (join: wait for W Hellos); Hello -> Setup (spawn: once rank 0
           named its TCPStore); Ready from every rank -> READY. A StartFailed, a rank's exit
           or ``start_timeout_s`` fails it: the first start raises ``RankStartError``; a
           re-form counts one attempt.
  READY    one step at a time, in submission order: StepRequest to every rank, replies
           gathered until the step's deadline. Idle ranks are pinged every ``heartbeat_s``.
  fail-stop  a rank exited, missed the deadline, broke the status exchange or is
           unreachable: the step's caller gets ``UnavailableError``, readiness goes false,
           the generation is killed (join: told to Shutdown), and after a backoff a new one
           forms: new processes, a new rendezvous. Steps submitted meanwhile fail at once.
  BACKOFF -> FORMING (join mode: at once when a rank says Hello); FAILED after
           ``max_restart_attempts`` consecutive failed re-forms.
  STOPPED  after ``request_stop``: queued and in-flight steps fail, ranks get Shutdown,
           the ones still running after ``stop_grace_s`` are killed; all are reaped.
Callers hand steps over through a queue (and a wake-up pipe); results go back through
``concurrent.futures.Future``. Everything else here belongs to the supervisor thread.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import msgspec
import zmq

from services.common.errors import UnavailableError
from services.common.progress import ProgressWatchdog
from services.common.ranks.channel import LeaderChannel, Malformed
from services.common.ranks.config import RankGroupConfig, RankMode, StepSpec
from services.common.ranks.errors import RankStartError
from services.common.ranks.generation import Generation, Slot
from services.common.ranks.handover import Results, StepHandover, Submitted
from services.common.ranks.messages import (
    Executed,
    Hello,
    Ping,
    Ready,
    Shutdown,
    StartFailed,
    StepReply,
    StepRequest,
    StepStatus,
    ToLeader,
)
from services.common.ranks.outcome import InFlight
from services.common.ranks.restarts import RestartPolicy

logger = logging.getLogger(__name__)
EXIT_GRACE_S = 0.5  # a rank that exits while starting gets this long for its StartFailed to arrive
MAX_POLL_S = 1.0


class GroupState(enum.Enum):
    FORMING = "forming"
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


class Supervisor:
    def __init__(
        self,
        config: RankGroupConfig,
        spec: StepSpec,
        on_ready_change: Callable[[bool], None],
        progress: ProgressWatchdog,
        rank_progress: Sequence[ProgressWatchdog],
    ) -> None:
        self.config = config
        self.spec = spec
        self.num_ranks = config.num_ranks
        self._on_ready_change = on_ready_change
        self._progress = progress
        self._rank_progress = tuple(rank_progress)
        self._decoder = msgspec.msgpack.Decoder(spec.result_type)
        self._handover = StepHandover()
        self._is_stopping = False
        self._is_finished = False
        self.started: Future[None] = Future()  # the first generation formed, or could not
        # Written by the supervisor thread only; read elsewhere as a snapshot.
        self.state = GroupState.FORMING
        self.control_addr = ""
        self.rank_pids: tuple[int, ...] = ()
        self._channel: LeaderChannel | None = None
        self._gen: Generation | None = None
        self._num_generations = 0
        self._inflight: InFlight | None = None
        self._next_step = 1
        self._restarts = RestartPolicy(config)
        self._restart_at_mono = 0.0
        self._last_ping_mono = 0.0
        self._last_error = ""

    # --- any thread -----------------------------------------------------------------
    def submit(self, payload: msgspec.Raw, timeout_s: float) -> Future[Results]:
        return self._handover.submit(payload, timeout_s)

    def request_stop(self) -> None:
        self._is_stopping = True
        self._handover.wake()

    def has_work(self) -> bool:
        return self._inflight is not None or not self._handover.is_empty()

    def is_step_in_flight(self) -> bool:
        return self._inflight is not None

    # --- the supervisor thread --------------------------------------------------------
    def run(self) -> None:
        try:
            try:
                self._channel = LeaderChannel(self.config.control_addr)
            except zmq.ZMQError as exc:
                raise RankStartError(f"{self.config.name}: cannot bind {self.config.control_addr}: {exc}") from exc
            self.control_addr = self._channel.addr
            self._begin_generation()
            while not self._is_stopping:
                self._poll_once()
        except BaseException as exc:  # a bug here must still end every caller and every rank
            if not isinstance(exc, RankStartError):
                logger.exception("%s: the supervisor failed", self.config.name)
            if not self.started.done():
                self.started.set_exception(exc)
        finally:
            self.finish()

    def _poll_once(self) -> None:
        assert self._channel is not None
        poller = zmq.Poller()
        poller.register(self._channel.socket, zmq.POLLIN)
        poller.register(self._handover.wake_fd, zmq.POLLIN)
        gen = self._gen
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
        for fd, slot in watched.items():
            if fd in events and self._gen is gen:  # still the same generation
                self._on_exit(slot)
        self._on_timers(time.monotonic())
        self._pump()

    def _next_timer_mono(self) -> float:
        timers = [time.monotonic() + MAX_POLL_S]
        gen = self._gen
        if self.state is GroupState.FORMING and gen is not None:
            timers.append(gen.deadline_mono)
            timers += [s.exited_at_mono + EXIT_GRACE_S for s in gen.slots if s.exited_at_mono is not None]
        elif self.state is GroupState.BACKOFF:
            timers.append(self._restart_at_mono)
        if self._inflight is not None:
            timers.append(self._inflight.deadline_mono)
        elif self.state is GroupState.READY:
            timers.append(self._last_ping_mono + self.config.heartbeat_s)
        return min(timers)

    def _on_timers(self, now: float) -> None:
        gen = self._gen
        if self.state is GroupState.FORMING and gen is not None:
            for slot in gen.slots:
                if slot.exited_at_mono is not None and now >= slot.exited_at_mono + EXIT_GRACE_S:
                    self._generation_failed(f"{slot.who} exited during start-up{gen.exit_text(slot)}")
                    return
            if now >= gen.deadline_mono:
                self._generation_failed(gen.forming_timeout_reason())
        elif self.state is GroupState.BACKOFF and now >= self._restart_at_mono:
            self._begin_generation()
        elif self._inflight is not None and now >= self._inflight.deadline_mono:
            self._fail_stop(self._inflight.deadline_reason())
        elif self.state is GroupState.READY and now >= self._last_ping_mono + self.config.heartbeat_s:
            self._ping(now)

    # --- messages ----------------------------------------------------------------------
    def _on_message(self, peer: bytes, message: ToLeader | Malformed) -> None:
        rank = self._gen.rank_of(peer) if self._gen is not None else None
        if isinstance(message, Malformed):
            self._on_malformed(rank, message.reason)
        elif isinstance(message, Hello):
            self._on_hello(peer, message)
        elif isinstance(message, StartFailed) and rank in (None, message.rank):
            self._on_start_failed(message)
        elif rank is None:
            logger.warning("%s: dropped %s from an unknown peer", self.config.name, type(message).__name__)
        elif message.rank != rank:
            self._on_malformed(rank, f"{type(message).__name__} claims rank {message.rank}")
        elif isinstance(message, Ready):
            self._on_ready(rank)
        elif isinstance(message, Executed):
            self._on_executed(rank, message)
        elif isinstance(message, StepReply):
            self._on_reply(rank, message)

    def _on_malformed(self, rank: int | None, reason: str) -> None:
        if rank is None:
            logger.warning("%s: dropped a malformed message from an unknown peer: %s", self.config.name, reason)
            return
        logger.error("%s: rank %d sent a malformed control message: %s", self.config.name, rank, reason)
        inflight = self._inflight
        if self.state is GroupState.FORMING:
            self._generation_failed(f"rank {rank} sent a malformed control message during start-up: {reason}")
        elif inflight is not None and rank not in inflight.replies:
            step = inflight.step
            inflight.add(rank, f"rank {rank} sent a malformed control message during step {step}: {reason}")
            self._maybe_finish()

    def _on_hello(self, peer: bytes, hello: Hello) -> None:
        assert self._channel is not None
        if self.state is GroupState.BACKOFF and self.config.mode is RankMode.JOIN:
            self._begin_generation()  # the deployment restarted its ranks: it paces the re-forms
        gen = self._gen
        if self.state is not GroupState.FORMING or gen is None:
            problem: str | None = f"the group is {self.state.value}, not forming"
        else:
            problem = gen.hello_problem(hello)
        if problem is not None:
            logger.warning("%s: refused the Hello of rank %d (pid %d): %s",
                           self.config.name, hello.rank, hello.pid, problem)
            self._channel.send(peer, Shutdown(step=self._next_step - 1))
            return
        assert gen is not None
        gen.accept(peer, hello)
        self._send_setups(gen)

    def _send_setups(self, gen: Generation) -> None:
        assert self._channel is not None
        setup = gen.setup(self.spec, self._next_step)
        for slot in gen.needing_setup():
            assert slot.peer is not None
            if not self._channel.send(slot.peer, setup):
                self._generation_failed(f"{slot.who} is unreachable during start-up")
                return
            slot.is_setup_sent = True

    def _on_start_failed(self, failed: StartFailed) -> None:
        gen = self._gen
        is_current = gen is not None and (not gen.is_spawn or failed.generation == gen.number)
        if self.state is not GroupState.FORMING or gen is None or not is_current:
            logger.warning("%s: stale start failure of rank %d: %s", self.config.name, failed.rank, failed.error)
            return
        in_range = 0 <= failed.rank < len(gen.slots)
        who = gen.slots[failed.rank].who if in_range else "a joining rank (before it knew its rank)"
        self._generation_failed(f"{who} failed to start at {failed.stage.value}: {failed.error}")

    def _on_ready(self, rank: int) -> None:
        if self.state is not GroupState.FORMING or self._gen is None:
            return
        self._gen.slots[rank].is_ready = True
        if self._gen.is_ready():
            self._become_ready()

    def _on_executed(self, rank: int, executed: Executed) -> None:
        if self._inflight is not None and executed.step == self._inflight.step:
            self._inflight.executed.add(rank)
            self._rank_progress[rank].tick()

    def _on_reply(self, rank: int, reply: StepReply) -> None:
        inflight = self._inflight
        if inflight is None or reply.step != inflight.step:
            logger.warning("%s: dropped rank %d's reply to step %d (not in flight)", self.config.name, rank, reply.step)
            return
        self._rank_progress[rank].tick()
        if reply.status is StepStatus.BROKEN:
            self._fail_stop(reply.error)
            return
        inflight.add(rank, reply)
        self._maybe_finish()

    def _on_exit(self, slot: Slot) -> None:
        slot.exited_at_mono = time.monotonic()
        if self.state is GroupState.READY:
            self._fail_stop(f"{slot.who} exited")  # _fail_stop names the exit code and the step

    # --- steps -------------------------------------------------------------------------
    def _pump(self) -> None:
        while self._inflight is None and (item := self._handover.take()) is not None:
            if self.state is GroupState.READY:
                self._send_step(item)
            else:
                item.future.set_exception(UnavailableError(self._unready_text()))

    def _send_step(self, item: Submitted) -> None:
        assert self._channel is not None and self._gen is not None
        step = self._next_step
        self._next_step += 1
        deadline = time.monotonic() + item.timeout_s
        self._inflight = InFlight(step, self.num_ranks, item.timeout_s, deadline, item.future)
        self._progress.tick()
        request = StepRequest(step=step, timeout_s=item.timeout_s, payload=item.payload)
        for slot in self._gen.slots:
            assert slot.peer is not None
            if not self._channel.send(slot.peer, request):
                self._fail_stop(f"{slot.who} is unreachable at step {step}")
                return

    def _maybe_finish(self) -> None:
        inflight = self._inflight
        if inflight is None or not inflight.is_complete():
            return
        self._inflight = None
        self._progress.tick()
        inflight.resolve(self._decoder)

    def _ping(self, now: float) -> None:
        assert self._channel is not None and self._gen is not None
        self._last_ping_mono = now
        for slot in self._gen.slots:
            assert slot.peer is not None
            if not self._channel.send(slot.peer, Ping(step=self._next_step - 1)):
                self._fail_stop(f"{slot.who} is unreachable (its connection is gone)")
                return

    # --- generations, fail-stop, restarts ----------------------------------------------
    def _begin_generation(self) -> None:
        assert self._channel is not None
        self._num_generations += 1
        gen = Generation(self._num_generations, self.config, time.monotonic() + self.config.start_timeout_s)
        self._gen, self.state = gen, GroupState.FORMING
        logger.info("%s: forming generation %d (%d ranks)", self.config.name, gen.number, self.num_ranks)
        if gen.is_spawn:
            try:
                gen.spawn(self.control_addr)
            except OSError as exc:
                self._generation_failed(f"cannot start the rank processes: {exc}")
                return
            self.rank_pids = gen.pids

    def _become_ready(self) -> None:
        assert self._gen is not None
        self.state, self._last_error = GroupState.READY, ""
        self._restarts.reset()
        self._last_ping_mono = time.monotonic()
        logger.info("%s: generation %d is ready", self.config.name, self._gen.number)
        self._notify_ready(True)
        if not self.started.done():
            self.started.set_result(None)

    def _generation_failed(self, reason: str) -> None:
        assert self._gen is not None
        logger.error("%s: generation %d failed to form: %s", self.config.name, self._gen.number, reason)
        self._end_generation()
        if not self.started.done():  # the first start is not retried: its error is the caller's
            self.state, self._last_error = GroupState.FAILED, reason
            self.started.set_exception(RankStartError(f"{self.config.name}: {reason}"))
            return
        self._schedule_restart(reason)

    def _fail_stop(self, reason: str) -> None:
        """Readiness off, the step's caller failed, the generation killed, a re-form scheduled."""
        gen = self._gen
        exited = gen.first_exited() if gen is not None else None
        if exited is not None and gen is not None:  # the likeliest cause: name it
            during = f" during step {self._inflight.step}" if self._inflight is not None else ""
            reason = f"{exited.who} exited{gen.exit_text(exited)}{during}"
        logger.error("%s: fail-stop: %s", self.config.name, reason)
        was_ready = self.state is GroupState.READY
        self.state, self._last_error = GroupState.BACKOFF, reason  # not ready before anyone hears of it
        if was_ready:
            self._notify_ready(False)
        if self._inflight is not None:
            self._inflight.future.set_exception(UnavailableError(f"{self.config.name}: {reason}"))
            self._inflight = None
        self._end_generation()
        self._schedule_restart(reason)

    def _end_generation(self, grace_s: float = 0.0) -> None:
        assert self._channel is not None
        if self._gen is not None:
            self._gen.end(self._channel, self._next_step - 1, grace_s)
        self._gen, self.rank_pids = None, ()

    def _schedule_restart(self, reason: str) -> None:
        self._last_error = reason
        backoff_s = self._restarts.next_backoff_s()
        if backoff_s is None:
            self.state = GroupState.FAILED
            logger.error("%s: giving up after %d failed re-forms", self.config.name, self._restarts.max_attempts)
            return
        self.state, self._restart_at_mono = GroupState.BACKOFF, time.monotonic() + backoff_s
        logger.warning("%s: re-forming in %.1f s (attempt %d of %d)", self.config.name, backoff_s,
                       self._restarts.num_attempts, self._restarts.max_attempts)

    def _notify_ready(self, is_ready: bool) -> None:
        try:
            self._on_ready_change(is_ready)
        except Exception:  # a callback's bug must not stop the supervisor
            logger.exception("%s: the readiness callback raised", self.config.name)

    def _unready_text(self) -> str:
        name, why = self.config.name, f" after: {self._last_error}" if self._last_error else ""
        if self.state is GroupState.FAILED:
            return f"{name}: the rank group failed for good{why}"
        if not self.started.done():
            return f"{name}: the rank group is still starting"
        return f"{name}: the rank group is re-forming{why}"

    def finish(self) -> None:
        """Fail every step, shut the ranks down (kill after the grace), release everything; idempotent."""
        if self._is_finished:
            return
        self._is_finished = True
        was_ready = self.state is GroupState.READY
        self.state = GroupState.STOPPED
        stopped = UnavailableError(f"{self.config.name}: the rank group is stopped")
        self._handover.close(stopped)
        if self._inflight is not None:
            self._inflight.future.set_exception(stopped)
            self._inflight = None
        if self._channel is not None:
            self._end_generation(self.config.stop_grace_s)
            self._channel.close()
        if was_ready:
            self._notify_ready(False)
        if not self.started.done():
            self.started.set_exception(RankStartError(f"{self.config.name}: stopped before the group formed"))
