"""How a leader runs its rank group: ``RankGroupConfig`` (frozen, built once) and ``StepSpec``."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import msgspec

_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}
_TCP = re.compile(r"^tcp://(?P<host>.*):(?P<port>\d+)$")
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


class RankMode(enum.Enum):
    SPAWN = "spawn"  # the leader starts one rank process per device on its own host
    JOIN = "join"  # a deployment starts the ranks; they join through env:// and connect here


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
    name: str = "ranks"  # in log lines, errors and watchdog names
    mode: RankMode = RankMode.SPAWN
    devices: tuple[str, ...] = ()  # spawn: one rank per entry ("cpu", "cuda:0", ...)
    world_size: int = 0  # join: how many ranks join; spawn: 0 (it is len(devices))
    # Where ranks connect. spawn: "" (a private ipc:// socket) or ipc://PATH or
    # tcp://127.0.0.1:PORT; join: required, ipc://PATH or tcp://HOST:PORT (never a wildcard).
    control_addr: str = ""
    step_timeout_s: float = 30.0  # a step's deadline unless its caller gives one
    start_timeout_s: float = 300.0  # spawn to Ready on every rank (model load, warm-up)
    collective_timeout_s: float = 30.0  # the ranks' process groups and their start-up barrier
    heartbeat_s: float = 1.0  # the leader pings idle ranks this often
    leader_timeout_s: float = 10.0  # a rank that hears nothing from its leader this long exits
    max_restart_attempts: int = 5  # consecutive failed re-forms before the group gives up
    restart_backoff_s: float = 1.0  # before the first re-form; doubles per failed attempt
    max_restart_backoff_s: float = 30.0
    stop_grace_s: float = 5.0  # after Shutdown, before the ranks still running are killed
    watchdog_s: float = 30.0  # the progress watchdogs' stall_s
    internal_token: str = ""  # Envs.internal_token: a rank's Hello must carry the same

    def __post_init__(self) -> None:
        self._check_ranks()
        self._check_control_addr()
        for field in (
            "step_timeout_s",
            "start_timeout_s",
            "collective_timeout_s",
            "heartbeat_s",
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

    @property
    def num_ranks(self) -> int:
        return len(self.devices) if self.mode is RankMode.SPAWN else self.world_size

    def _check_ranks(self) -> None:
        if self.mode is RankMode.SPAWN:
            if not self.devices:
                raise ValueError("spawn mode needs at least one device (e.g. devices=('cpu',))")
            if self.world_size not in (0, len(self.devices)):
                raise ValueError(
                    f"spawn mode: world_size is len(devices)={len(self.devices)}; "
                    f"leave it 0, got {self.world_size}"
                )
            bad = [d for d in self.devices if not _DEVICE.match(d)]
            if bad:
                raise ValueError(f"devices must be 'cpu' or 'cuda:N', got {bad}")
        else:
            if self.devices:
                raise ValueError(
                    "join mode: each rank names its own device (--device); leave devices empty"
                )
            if self.world_size < 1:
                raise ValueError(f"join mode needs world_size >= 1, got {self.world_size}")

    def _check_control_addr(self) -> None:
        addr = self.control_addr
        if not addr:
            if self.mode is RankMode.JOIN:
                raise ValueError("join mode needs control_addr (tcp://HOST:PORT or ipc://PATH)")
            return
        if addr.startswith("ipc://") and len(addr) > len("ipc://"):
            return
        match = _TCP.match(addr)
        if match is None:
            raise ValueError(f"control_addr {addr!r} is not ipc://PATH or tcp://HOST:PORT")
        host = match["host"]
        if host in _WILDCARD_HOSTS:
            raise ValueError(f"control_addr {addr!r}: bind a named interface, never a wildcard")
        if self.mode is RankMode.SPAWN and host not in _LOOPBACK_HOSTS:
            raise ValueError(
                f"spawn mode: control_addr {addr!r} must be loopback (the ranks are local)"
            )
