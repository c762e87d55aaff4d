"""One formation of a rank group: its members, their processes and their zmq peers.

A formation is born FORMING (its processes spawned), accepts one Hello per rank, and
ends for good: its processes are told to Shutdown, then killed and reaped. A re-formed
group is a new formation with new processes and a new rendezvous. Owned by the
supervisor thread.
"""

from __future__ import annotations

import hmac
import select
import signal
import time
from dataclasses import dataclass

from services.common.ranks.channel import LeaderChannel
from services.common.ranks.config import JOIN, RankGroupConfig, StepSpec
from services.common.ranks.messages import (
    ANY_FORMATION,
    Hello,
    Setup,
    Shutdown,
    StartFailed,
    encode_raw,
)
from services.common.ranks.procs import RankLaunch, RankProcess, kill_all, stop_all

EXIT_GRACE_S = 0.5  # a rank that exits while starting gets this long for its StartFailed to arrive


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else device


def describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


@dataclass
class Member:
    rank: int
    device: str
    process: RankProcess | None = None  # once spawned
    peer: bytes | None = None  # its zmq routing id, from its Hello
    is_setup_sent: bool = False
    is_ready: bool = False
    exited_at_mono: float | None = None
    is_joining: bool = False  # started on another host (no process here); its Hello names it
    joined_pid: int = 0  # a joining rank's pid on its own host, from its Hello

    @property
    def who(self) -> str:
        if self.is_joining:
            pid = f", pid {self.joined_pid} on its host" if self.joined_pid else ""
            return f"rank {self.rank} (joining, {self.device}{pid})"
        pid = f", pid {self.process.pid}" if self.process is not None else ""
        return f"rank {self.rank} ({self.device}{pid})"


class Formation:
    def __init__(self, number: int, config: RankGroupConfig, deadline_mono: float) -> None:
        self.number = number
        self.config = config
        self.deadline_mono = deadline_mono  # FORMING must end by then
        self.members = [
            Member(rank, device, is_joining=device == JOIN)
            for rank, device in enumerate(config.devices)
        ]
        self.store_port = 0  # rank 0's TCPStore, from its Hello
        self._peers: dict[bytes, int] = {}

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(s.process.pid for s in self.members if s.process is not None)

    def spawn(self, control_addr: str) -> None:
        """Start one process per rank of this host (not the joining ones); raises OSError."""
        for member in self.members:
            if member.is_joining:
                continue
            launch = RankLaunch(
                control_addr,
                self.number,
                member.rank,
                len(self.members),
                member.device,
                self.config.start_timeout_s,
                self.config.rank_module,
                self.config.host,
                self.config.internal_token,
            )
            member.process = RankProcess(launch)

    def rank_of(self, peer: bytes) -> int | None:
        return self._peers.get(peer)

    def hello_problem(self, hello: Hello) -> str | None:
        """Why this Hello cannot take its rank's member, or None."""
        if not hmac.compare_digest(hello.token.encode(), self.config.internal_token.encode()):
            return "its internal token does not match"
        if hello.world_size != len(self.members) or not 0 <= hello.rank < len(self.members):
            size = len(self.members)
            return f"rank {hello.rank} of {hello.world_size} does not fit a group of {size}"
        member = self.members[hello.rank]
        if member.is_joining and hello.formation not in (ANY_FORMATION, self.number):
            return f"formation {hello.formation}, expected {self.number} (or {ANY_FORMATION})"
        if not member.is_joining and hello.formation != self.number:
            return f"formation {hello.formation}, expected {self.number}"
        if member.peer is not None:
            return "that rank said Hello already"
        if member.is_joining and _kind(hello.device) != _kind(self.config.devices[0]):
            return f"it brings {hello.device}; the group's ranks run on {self.config.devices[0]}"
        if member.process is not None and member.process.pid != hello.pid:
            return f"rank {hello.rank} is pid {member.process.pid}"
        return None

    def take_hello(self, peer: bytes, hello: Hello) -> str | None:
        """Give ``hello``'s rank its member; or why it cannot have it (the caller refuses it)."""
        problem = self.hello_problem(hello)
        if problem is None:
            self.accept(peer, hello)
        return problem

    def start_failure(self, failed: StartFailed, peer: bytes) -> str | None:
        """This formation's failure for ``failed`` (from ``peer``); None when it is no rank of
        this one. A joining rank knows no formation: its failure counts while its member has no
        other peer."""
        if not 0 <= failed.rank < len(self.members):
            return None
        member = self.members[failed.rank]
        is_joiner = member.is_joining and failed.formation == ANY_FORMATION
        if is_joiner and member.peer not in (None, peer):
            return None
        if failed.formation != self.number and not is_joiner:
            return None
        who = member.who
        return f"{who} failed to start at {failed.stage.value}: {failed.error}"

    def mark_ready(self, rank: int) -> bool:
        """Whether every rank is ready now."""
        self.members[rank].is_ready = True
        return self.is_ready()

    def next_timer_mono(self) -> float:
        """When ``forming_failure`` may next have news."""
        exits = [
            s.exited_at_mono + EXIT_GRACE_S for s in self.members if s.exited_at_mono is not None
        ]
        return min([self.deadline_mono, *exits])

    def forming_failure(self, now: float) -> str | None:
        """Why forming has failed by ``now`` (a rank exited, the deadline passed), or None."""
        for member in self.members:
            if member.exited_at_mono is not None and now >= member.exited_at_mono + EXIT_GRACE_S:
                return f"{member.who} exited during start-up{self.exit_text(member)}"
        return self.forming_timeout_reason() if now >= self.deadline_mono else None

    def exit_cause(self, step: int | None, grace_s: float = 0.0) -> str | None:
        """A rank that has exited (lowest first), as a fail-stop reason; or None.

        ``grace_s``: how long to wait for an exit to show (a peer saw its connections close
        first: the kernel closes a dying process's sockets before its exit can be reaped).
        """
        deadline_mono = time.monotonic() + grace_s
        while True:
            for member in self.members:
                if member.process is not None and member.process.exit_code() is not None:
                    during = f" during step {step}" if step is not None else ""
                    return f"{member.who} exited{self.exit_text(member)}{during}"
            remaining_s = deadline_mono - time.monotonic()
            exit_fds = list(self.exit_watch())
            if remaining_s <= 0 or not exit_fds:
                return None
            select.select(exit_fds, [], [], remaining_s)  # a pidfd turns readable at exit

    def accept(self, peer: bytes, hello: Hello) -> None:
        member = self.members[hello.rank]
        member.peer, member.device = peer, hello.device
        if member.is_joining:
            member.joined_pid = hello.pid
        self._peers[peer] = hello.rank
        if hello.rank == 0:
            self.store_port = hello.store_port

    def needing_setup(self) -> list[Member]:
        """Slots whose Setup can go out now: once rank 0 named its store; in a group with joining
        ranks, once every rank said Hello (a pod may come minutes late: the rendezvous, bounded
        by the collective timeout, starts only when all are here)."""
        if self.members[0].peer is None:
            return []
        if any(s.is_joining for s in self.members) and any(s.peer is None for s in self.members):
            return []
        return [s for s in self.members if s.peer is not None and not s.is_setup_sent]

    def setup(self, spec: StepSpec, first_step: int) -> Setup:
        return Setup(
            step_target=spec.target,
            init=encode_raw(spec.init),
            first_step=first_step,
            store_host=self.config.host,
            store_port=self.store_port,
            collective_timeout_s=self.config.collective_timeout_s,
            leader_timeout_s=self.config.leader_timeout_s,
            is_free_running=self.config.is_free_running,
            step_timeout_s=self.config.step_timeout_s,
        )

    def is_ready(self) -> bool:
        return all(s.is_ready for s in self.members)

    def exit_watch(self) -> dict[int, Member]:
        """pidfd -> member of every process not yet seen exiting."""
        return {
            s.process.exit_fd: s
            for s in self.members
            if s.process is not None and s.exited_at_mono is None
        }

    def exit_text(self, member: Member) -> str:
        code = member.process.exit_code() if member.process is not None else None
        return f" with {describe_exit(code)}" if code is not None else ""

    def forming_timeout_reason(self) -> str:
        no_hello = [s.rank for s in self.members if s.peer is None]
        not_ready = [s.rank for s in self.members if s.peer is not None and not s.is_ready]
        parts = []
        if no_hello:
            absent = [r for r in no_hello if self.members[r].is_joining]
            joining = f" (joining from other hosts: {absent})" if absent else ""
            parts.append(f"no Hello from ranks {no_hello}{joining}")
        if not_ready:
            parts.append(f"no Ready from ranks {not_ready}")
        timeout_s = self.config.start_timeout_s
        return f"the group did not form within {timeout_s:.1f} s ({'; '.join(parts)})"

    def end(self, channel: LeaderChannel, last_step: int, grace_s: float = 0.0) -> None:
        """Tell every connected rank to Shutdown, wait ``grace_s`` for exits, kill the rest,
        reap."""
        for member in self.members:
            if member.peer is not None:
                channel.send(member.peer, Shutdown(step=last_step))
        processes = [s.process for s in self.members if s.process is not None]
        if grace_s > 0:
            stop_all(processes, grace_s)
        else:
            kill_all(processes)
        self._peers.clear()
