"""Rank processes apart from an in-process leader: an idle rank frozen with SIGSTOP, CUDA
ranks over NCCL, ranks that die with their leader, and the listening sockets of spawned
ranks."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.common.ranks_group_helpers import (
    REPO,
    START_TIMEOUT_S,
    is_gone,
    running,
    wait_for,
)
from tests.common.test_ranks_steps import EchoPayload

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]
LIVENESS_S = 3.0


async def test_an_idle_rank_frozen_with_sigstop_is_killed_and_the_group_reforms(caplog) -> None:
    """Busy in a step longer than the liveness bound, a rank is not dead; idle and silent, it
    is: fail-stop naming it, killed and reaped, then a new formation serves."""
    caplog.set_level(logging.ERROR, logger="services.common.ranks.supervisor")
    async with running(("cpu", "cpu"), heartbeat_s=0.5, liveness_timeout_s=LIVENESS_S) as run:
        await run.group.step(EchoPayload(value=1, sleep_s=LIVENESS_S + 1.0), timeout_s=60.0)
        await run.group.step(EchoPayload(value=1))
        assert run.readiness == [True]
        frozen_pid, other_pid = run.group.rank_pids[1], run.group.rank_pids[0]
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        os.kill(frozen_pid, signal.SIGSTOP)  # on failure, the group's stop kills it
        await wait_for(lambda: run.readiness == [True, False], LIVENESS_S + 10.0)
        assert loop.time() - frozen_at < LIVENESS_S + 10.0
        await wait_for(lambda: is_gone(frozen_pid), 10.0)  # killed and reaped, not left stopped
        reasons = [r.getMessage() for r in caplog.records if "fail-stop" in r.getMessage()]
        assert len(reasons) == 1, reasons
        assert re.search(rf"rank 1 \(cpu, pid {frozen_pid}\) answered no ping for \d", reasons[0])
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)
        assert not {frozen_pid, other_pid} & set(run.group.rank_pids)
        assert [r.device_total for r in await run.group.step(EchoPayload(value=2))] == [4, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("num_gpus", [1, 2])
async def test_cuda_ranks_bind_their_device_and_all_reduce_over_nccl(num_gpus: int) -> None:
    import torch

    if torch.cuda.device_count() < num_gpus:
        pytest.skip(f"needs {num_gpus} CUDA devices")
    async with running(tuple(f"cuda:{i}" for i in range(num_gpus))) as run:
        results = await run.group.step(EchoPayload(value=3))
        assert [(r.rank, r.device_total, r.cpu_total) for r in results] == [
            (r, 3 * num_gpus, 3 * num_gpus) for r in range(num_gpus)
        ]


LEADER = """
import asyncio
from services.common.envs import Envs
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoResult

async def main():
    token = Envs.from_environ().internal_token
    config = RankGroupConfig(devices=("cpu", "cpu"), start_timeout_s=300, internal_token=token)
    group = RankGroup(config, StepSpec(TARGET, EchoResult, EchoInit(warmup_sleep_s=300)))
    starting = asyncio.ensure_future(group.start())
    while not group.rank_pids:
        await asyncio.sleep(0.01)
    print(group.control_addr, *group.rank_pids, flush=True)
    await starting

asyncio.run(main())
"""


def is_dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (its parent, the leader, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_ranks_die_with_their_leader_even_while_starting() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    rank_pids: list[int] = []
    control_dir = ""
    try:
        control_addr, *pids = (await asyncio.to_thread(leader.stdout.readline)).split()
        control_dir = os.path.dirname(control_addr.removeprefix("ipc://"))
        rank_pids += [int(p) for p in pids]
        assert len(rank_pids) == 2
        await asyncio.sleep(1.0)  # the ranks are importing torch or warming up (300 s)
        leader.kill()
        await asyncio.to_thread(leader.wait, 10)
        await wait_for(lambda: all(is_dead(pid) for pid in rank_pids), 30.0)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        for pid in rank_pids:  # on failure: exactly the ranks that leader started
            if not is_dead(pid):
                os.kill(pid, signal.SIGKILL)
        if control_dir.startswith(tempfile.gettempdir()):  # the killed leader could not remove it
            shutil.rmtree(control_dir, ignore_errors=True)


async def test_spawned_ranks_listen_on_loopback_only() -> None:
    """Rank 0's rendezvous store and every gloo group of a spawned group accept loopback only
    (a TCPStore on its own listens on every interface)."""
    from tests.e2e.test_ports import is_loopback_only, listening_sockets

    async with running(("cpu", "cpu")) as run:
        await run.group.step(EchoPayload(value=1))
        sockets = {pid: listening_sockets(pid) for pid in run.group.rank_pids}
        assert all(sockets.values()), sockets  # the store and gloo do listen
        assert all(
            is_loopback_only(address) for found in sockets.values() for address, _ in found
        ), sockets
