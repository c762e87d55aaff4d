"""Shared helpers of the tests of rank groups of real processes on CPU (gloo)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys

from services.common.envs import INTERNAL_TOKEN_ENV, Envs
from services.common.ranks.config import RANK_MAIN, RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoResult
from tests.conftest import rank_children

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "the group's token"  # of groups with ranks that join (tests set it in the environment)
START_TIMEOUT_S = 120.0  # several torch imports at once on a loaded 2-core machine


def is_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def config(devices: tuple[str, ...], **overrides) -> RankGroupConfig:
    settings = dict(
        devices=devices,
        step_timeout_s=3.0,
        start_timeout_s=START_TIMEOUT_S,
        collective_timeout_s=5.0,
        heartbeat_s=0.5,
        leader_timeout_s=10.0,
        restart_backoff_s=0.1,
        stop_grace_s=3.0,
        internal_token=Envs.from_environ().internal_token,  # what the spawned ranks inherit
    )
    settings.update(overrides)
    return RankGroupConfig(**settings)


class Running:
    def __init__(self, group: RankGroup, readiness: list[bool]) -> None:
        self.group, self.readiness = group, readiness


@contextlib.asynccontextmanager
async def running(
    devices: tuple[str, ...] = ("cpu", "cpu"), init: EchoInit = EchoInit(), **overrides
):
    readiness: list[bool] = []
    group = RankGroup(
        config(devices, **overrides),
        StepSpec(TARGET, EchoResult, init),
        on_ready_change=readiness.append,
    )
    try:
        await group.start()
        yield Running(group, readiness)
    finally:
        await group.aclose()
        assert rank_children() == []


async def wait_for(predicate, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline_mono = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline_mono, "condition not reached in time"
        await asyncio.sleep(0.02)


def control_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def join_agent(leader: str, host: str, token: str = TOKEN, env: dict[str, str] | None = None):
    """``stageserve join-rank`` for rank 1 of 2 on ``host``, with ``token``; ``env``: more of its
    environment."""
    argv = ["--leader", leader, "--rank", "1", "--world-size", "2", "--host", host]
    agent = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "join-rank", *argv, "--retry-s", "0.2"],
        cwd=REPO,
        env={**os.environ, **(env or {}), INTERNAL_TOKEN_ENV: token},
    )
    try:
        yield agent
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0  # it stopped its rank and exited
        assert agent_ranks(agent) == []


def agent_ranks(agent: subprocess.Popen) -> list[int]:
    """The agent's rank processes now."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if parent == agent.pid and RANK_MAIN.encode() in cmdline:
            found.append(int(entry))
    return found
