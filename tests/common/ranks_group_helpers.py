"""Shared helpers of the tests of rank groups of real processes on CPU (gloo)."""

from __future__ import annotations

import asyncio
import contextlib
import os

from services.common.envs import Envs
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoResult
from tests.conftest import rank_children

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
