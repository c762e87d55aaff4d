"""How a leader runs its rank group: ``RankGroupConfig`` (frozen, built once) and ``StepSpec``."""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}
_TCP = re.compile(r"^tcp://(?P<host>.*):(?P<port>\d+)$")
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
JOIN = "join"  # a ``devices`` entry: the rank is started on another host and joins (``join.py``)
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
RANK_MAIN = "services.common.ranks.rank_main"


@dataclass(frozen=True)
class StepSpec:
    """The step every rank runs, and the types the leader needs of it."""

    target: str  # "package.module:ClassName", a BaseRankStep subclass, imported by each rank
    result_type: type[
        msgspec.Struct
    ]  # that class's result_type: the leader decodes replies with it
    init: msgspec.Struct  # that class's init_type instance, handed to its constructor on every rank

    def __post_init__(self) -> None:
        module, _, name = self.target.partition(":")
        if not module or not name:
            raise ValueError(f"step target {self.target!r} is not 'package.module:ClassName'")


@dataclass(frozen=True)
class RankGroupConfig:
    """How a leader runs its rank group: one rank process per ``devices`` entry.

    ``rank_module`` is the module every rank process runs (``python -m``, with the arguments
    of ``procs.RankLaunch``): ``rank_main``, the rank of every service. A test names a fake
    rank there that speaks the control protocol by hand (``tests/common/fake_rank.py``).
    """

    name: str = "ranks"  # in log lines, errors and watchdog names
    # One rank per entry: the leader spawns "cpu" and "cuda:N" ranks; a "join" rank is started on
    # another host (``join.py``: a LeaderWorkerSet's worker pod) and brings its own device.
    devices: tuple[str, ...] = ()
    # Where ranks connect: "" (a private ipc:// socket), ipc://PATH or tcp://127.0.0.1:PORT; with
    # join ranks, tcp://HOST:PORT on this host's address that they reach (``host``).
    control_addr: str = ""
    # The address rank 0's rendezvous store and every spawned rank's gloo device listen on:
    # loopback, unless ranks join from other hosts (then the control address's host).
    host: str = "127.0.0.1"
    step_timeout_s: float = 30.0  # a step's deadline unless its caller gives one
    start_timeout_s: float = 300.0  # spawn to Ready on every rank (model load, warm-up)
    collective_timeout_s: float = 30.0  # the ranks' process groups and their start-up barrier
    heartbeat_s: float = 1.0  # the leader pings idle ranks this often
    liveness_timeout_s: float = 10.0  # an idle rank that answers no ping this long is dead
    leader_timeout_s: float = 10.0  # a rank that hears nothing from its leader this long exits
    max_restart_attempts: int = 5  # consecutive failed re-forms before the group gives up
    restart_backoff_s: float = 1.0  # before the first re-form; doubles per failed attempt
    max_restart_backoff_s: float = 30.0
    stop_grace_s: float = 5.0  # after Shutdown, before the ranks still running are killed
    watchdog_s: float = 30.0  # the progress watchdogs' stall_s
    internal_token: str = ""  # Envs.internal_token: a rank's Hello must carry the same
    rank_module: str = RANK_MAIN
    # Rank 0 steps by itself and reports unsolicited (``free_supervisor.py``); ranks 1.. follow it
    # (they run its collectives, told by rank 0 what to run). The step class is a
    # ``FreeRankStep``. A group with work whose rank 0 reports nothing for step_timeout_s hangs.
    is_free_running: bool = False

    def __post_init__(self) -> None:
        self._check_ranks()
        self._check_control_addr()
        if not _MODULE.match(self.rank_module):
            raise ValueError(f"rank_module {self.rank_module!r} is not a dotted module name")
        for field in (
            "step_timeout_s",
            "start_timeout_s",
            "collective_timeout_s",
            "heartbeat_s",
            "liveness_timeout_s",
            "leader_timeout_s",
            "restart_backoff_s",
            "stop_grace_s",
            "watchdog_s",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.max_restart_attempts < 0:
            raise ValueError(f"max_restart_attempts must be >= 0, got {self.max_restart_attempts}")
        if self.leader_timeout_s <= self.heartbeat_s:
            raise ValueError(
                "leader_timeout_s must exceed heartbeat_s (ranks would leave an idle leader)"
            )
        if self.liveness_timeout_s <= self.heartbeat_s:
            raise ValueError(
                "liveness_timeout_s must exceed heartbeat_s (idle ranks would be declared dead)"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def joining(self) -> tuple[int, ...]:
        """The ranks that join from other hosts (never spawned here)."""
        return tuple(rank for rank, device in enumerate(self.devices) if device == JOIN)

    def _check_ranks(self) -> None:
        if not self.devices:
            raise ValueError("a rank group needs at least one device (e.g. devices=('cpu',))")
        bad = [d for d in self.devices if not _DEVICE.match(d) and d != JOIN]
        if bad:
            raise ValueError(f"devices must be 'cpu', 'cuda:N' or 'join', got {bad}")
        if self.devices[0] == JOIN:
            raise ValueError("rank 0 runs beside its leader: devices[0] cannot be 'join'")

    def _check_control_addr(self) -> None:
        addr = self.control_addr
        if self.joining:
            self._check_join_addr()
            return
        if self.host not in _LOOPBACK_HOSTS:
            raise ValueError(f"host {self.host!r} must be loopback (every rank is spawned here)")
        if not addr:
            return
        if addr.startswith("ipc://") and len(addr) > len("ipc://"):
            return
        host = self._tcp_host(addr)
        if host not in _LOOPBACK_HOSTS:
            raise ValueError(f"control_addr {addr!r} must be loopback (the ranks are local)")

    def _check_join_addr(self) -> None:
        """Ranks on other hosts reach the control socket and rank 0's store on ``host``."""
        addr = self.control_addr
        if not addr.startswith("tcp://"):
            raise ValueError(
                f"ranks {list(self.joining)} join from other hosts: control_addr must be "
                f"tcp://HOST:PORT on an address they reach, got {addr!r}"
            )
        host = self._tcp_host(addr)
        if host != self.host:
            raise ValueError(f"control_addr {addr!r} and host {self.host!r} must name one address")
        if addr.endswith(":0"):
            raise ValueError(f"control_addr {addr!r}: joining ranks need a fixed port")
        if not self.internal_token:
            raise ValueError(
                "ranks that join from other hosts need an internal token (it authenticates "
                "their Hello and keys the control channel's encryption)"
            )

    @staticmethod
    def _tcp_host(addr: str) -> str:
        match = _TCP.match(addr)
        if match is None:
            raise ValueError(f"control_addr {addr!r} is not ipc://PATH or tcp://HOST:PORT")
        host = match["host"]
        if host in _WILDCARD_HOSTS:
            raise ValueError(f"control_addr {addr!r}: bind a named interface, never a wildcard")
        return host
