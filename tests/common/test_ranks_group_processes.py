"""Rank processes apart from an in-process leader: ranks started apart that join through
env://, CUDA ranks over NCCL, ranks that die with their leader, and the listening sockets of
spawned ranks."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from benchmarks.system_load import free_port
from services.common.errors import UnavailableError
from services.common.ranks.config import RankMode, StepSpec
from services.common.ranks.group import RankGroup
from services.common.ranks.rank_loop import STUCK_EXIT_GRACE_S, LoopExit
from tests.common.ranks_group_helpers import (
    REPO,
    START_TIMEOUT_S,
    config,
    running,
    wait_for,
)
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoPayload, EchoResult
from tests.conftest import RANK_MAIN

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]


async def test_ranks_started_apart_join_through_env_and_a_leader_attaches(tmp_path) -> None:
    """A deployment's ranks: env:// rendezvous, then the same path; stuck ones exit by
    themselves."""
    control_addr = f"ipc://{tmp_path}/control"
    master_port = str(free_port())
    ranks = []
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master_port,
                STAGESERVE_INTERNAL_TOKEN="join-token",  # what the deployment gives every pod
            )
            argv = [
                sys.executable,
                "-m",
                RANK_MAIN,
                "--join",
                "--leader",
                control_addr,
                "--device",
                "cpu",
                "--rendezvous-timeout-s",
                str(START_TIMEOUT_S),
            ]
            ranks.append(subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL))
        join = config(
            (),
            mode=RankMode.JOIN,
            world_size=2,
            control_addr=control_addr,
            internal_token="join-token",
        )
        group = RankGroup(join, StepSpec(TARGET, EchoResult, EchoInit()))
        await group.start()
        try:
            results = await group.step(EchoPayload(value=4))
            assert [(r.rank, r.world_size, r.device_total, r.cpu_total) for r in results] == [
                (0, 2, 8, 8),
                (1, 2, 8, 8),
            ]
            assert [r.pid for r in results] == [p.pid for p in ranks]
            # Stuck past the deadline: the leader fail-stops; the ranks, which it cannot kill, end
            # themselves.
            with pytest.raises(
                UnavailableError, match="did not finish step 2 within its 1.0 s deadline"
            ):
                await group.step(EchoPayload(value=1, sleep_s=60.0), timeout_s=1.0)
            assert not group.is_ready
            codes = [
                await asyncio.to_thread(p.wait, 1.0 + STUCK_EXIT_GRACE_S + 10.0) for p in ranks
            ]
            assert codes == [LoopExit.STUCK, LoopExit.STUCK]
        finally:
            await group.aclose()
    finally:
        for process in ranks:  # exactly the processes this test started
            if process.poll() is None:
                process.kill()
                process.wait()


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
