"""Rank groups of real processes on CPU (gloo): results in order, agreed failures, a rank
SIGKILLed or SIGSTOPped mid-step (fail-stop, then the group re-forms and serves), ranks that
cannot start, and ranks started apart that join through env://. Every test ends with no
rank process of this test process left running or unreaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from services.common.envs import Envs
from services.common.errors import CapacityError, UnavailableError
from services.common.ranks.config import RankGroupConfig, RankMode, StepSpec
from services.common.ranks.errors import RankStartError, StepFailedError
from services.common.ranks.group import RankGroup
from services.common.ranks.rank_loop import STUCK_EXIT_GRACE_S, LoopExit
from tests.common.test_ranks_steps import TARGET, EchoInit, EchoPayload, EchoResult, Garbage
from tests.conftest import RANK_MAIN, rank_children

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 120.0  # several torch imports at once on a loaded 2-core machine


@pytest.fixture(autouse=True)
def rank_env(monkeypatch):
    """What the spawned ranks inherit: one thread each, and this repo importable."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    )


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
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_steps_return_every_ranks_result_in_order_while_the_loop_runs(
    world_size: int,
) -> None:
    async with running(("cpu",) * world_size) as run:
        pids = run.group.rank_pids
        assert (
            len(set(pids)) == world_size and os.getpid() not in pids
        )  # R = 1 too: its own process
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.ensure_future(ticker())
        try:
            results = await asyncio.gather(
                *(run.group.step(EchoPayload(value=v, sleep_s=0.1)) for v in range(4))
            )
        finally:
            ticking.cancel()
        for i, per_rank in enumerate(results):
            assert [(r.step, r.rank, r.world_size) for r in per_rank] == [
                (i + 1, r, world_size) for r in range(world_size)
            ]
            assert {(r.value, r.device_total, r.cpu_total, r.num_executed) for r in per_rank} == {
                (i, i * world_size, i * world_size, i + 1)
            }
            assert tuple(r.pid for r in per_rank) == pids
        assert ticks >= 10  # four steps of >= 0.1 s each ran beside the ticker, not instead of it
        assert run.readiness == [True]
    assert all(is_gone(pid) for pid in pids)


async def test_the_ranks_listen_on_loopback_only() -> None:
    """Rank 0's TCPStore (and the gloo pairs) accept no connection from another host."""
    from tests.e2e.test_ports import is_loopback_only, listening_sockets

    async with running(("cpu", "cpu")) as run:
        found = {pid: listening_sockets(pid) for pid in run.group.rank_pids}
        assert found[run.group.rank_pids[0]], "rank 0 serves the group's TCPStore"
        exposed = {
            pid: [s for s in sockets if not is_loopback_only(s[0])]
            for pid, sockets in found.items()
        }
        assert not any(exposed.values()), exposed


async def test_a_rank_failing_mid_step_fails_it_alike_everywhere_and_the_next_step_runs() -> None:
    async with running(("cpu", "cpu"), heartbeat_s=0.5, leader_timeout_s=1.5) as run:
        with pytest.raises(StepFailedError) as caught:
            await run.group.step(EchoPayload(value=5, raise_on_rank=1))
        text = "step 1 failed on rank 1: RuntimeError: injected failure at value 5"
        assert caught.value.message == text
        after = await run.group.step(EchoPayload(value=1))
        assert [r.last_error for r in after] == [text, text]  # every rank was told the same text
        with pytest.raises(
            CapacityError,
            match=r"^step 3 failed on rank 0: CapacityError: injected: no pages left$",
        ):
            await run.group.step(EchoPayload(value=1, capacity_error_on_rank=0))
        with pytest.raises(
            StepFailedError, match=r"^step 4 failed on rank 0: malformed step payload: .*`value`"
        ):
            await run.group.step(
                Garbage(junk="not an EchoPayload")
            )  # a garbage payload: agreed, not fatal
        last = await run.group.step(EchoPayload(value=2))
        assert [(r.step, r.device_total, r.num_executed) for r in last] == [
            (5, 4, 4),
            (5, 4, 4),
        ]  # 4 never ran
        assert last[0].last_error.startswith("step 4 failed on rank 0: malformed step payload")
        # A step longer than leader_timeout_s (no pings while busy) does not orphan the ranks.
        await run.group.step(EchoPayload(value=1, sleep_s=2.0))
        assert [r.num_executed for r in await run.group.step(EchoPayload(value=1))] == [6, 6]
        assert run.group.is_ready and run.readiness == [True]


async def test_a_sigkilled_rank_fails_the_step_unavailable_and_the_group_reforms() -> None:
    async with running(("cpu", "cpu")) as run:
        old_pids = run.group.rank_pids
        start = asyncio.get_running_loop().time()
        with pytest.raises(
            UnavailableError,
            match=r"rank 1 \(cpu, pid \d+\) exited with signal SIGKILL during step 1",
        ):
            await run.group.step(EchoPayload(value=1, kill_on_rank=1))
        assert asyncio.get_running_loop().time() - start < 3.0  # within the step deadline
        assert run.readiness == [True, False] and not run.group.is_ready
        with pytest.raises(UnavailableError, match="re-forming after: rank 1"):
            await run.group.step(EchoPayload(value=1))
        await wait_for(
            lambda: all(is_gone(pid) for pid in old_pids), 10.0
        )  # rank 0 went down with it
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)
        assert run.readiness == [True, False, True]
        results = await run.group.step(EchoPayload(value=3))
        assert [(r.rank, r.device_total, r.num_executed) for r in results] == [(0, 6, 1), (1, 6, 1)]
        assert not set(r.pid for r in results) & set(old_pids)  # new processes


async def test_the_caller_of_a_failed_step_hears_only_once_every_rank_is_gone() -> None:
    """Rank 0 is still inside the step (it could be writing into a peer's memory) when rank 1
    dies: by the time the caller's future fails, rank 0 is killed and reaped too."""
    async with running(("cpu", "cpu")) as run:
        pids = run.group.rank_pids
        alive_when_failed: list[list[int]] = []
        future = run.group.submit(EchoPayload(value=1, kill_on_rank=1, sleep_s=5.0))
        # Runs in the thread that fails the future, at that very moment.
        future.add_done_callback(
            lambda _: alive_when_failed.append([p for p in pids if not is_gone(p)])
        )
        with pytest.raises(UnavailableError, match="rank 1"):
            await asyncio.wrap_future(future)
        assert alive_when_failed == [[]]


async def test_a_rank_whose_connections_close_before_it_exits_is_named_as_the_cause() -> None:
    """Rank 0's status exchange breaks on the lost connection before rank 1's exit shows:
    the step's error still names rank 1 and its exit, not rank 0's broken exchange."""
    async with running(("cpu", "cpu")) as run:
        with pytest.raises(
            UnavailableError, match=r"rank 1 \(cpu, pid \d+\) exited with code 7 during step 1"
        ):
            await run.group.step(EchoPayload(value=1, leave_on_rank=1))
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)


async def test_a_sigstopped_rank_fails_the_step_within_its_deadline_and_is_killed() -> None:
    async with running(("cpu", "cpu"), step_timeout_s=2.0, watchdog_s=0.5) as run:
        stopped_pid = run.group.rank_pids[1]
        start = asyncio.get_running_loop().time()
        step = asyncio.ensure_future(run.group.step(EchoPayload(value=1, stop_on_rank=1)))
        await wait_for(run.group.progress.is_stalled, 1.8)  # the watchdogs see the stall first
        assert run.group.rank_progress[1].is_stalled()
        with pytest.raises(
            UnavailableError, match=r"did not finish step 1 within its 2.0 s deadline"
        ):
            await step
        assert asyncio.get_running_loop().time() - start < 2.0 + 1.0
        assert run.readiness == [True, False]
        await wait_for(lambda: is_gone(stopped_pid), 10.0)  # killed and reaped, not leaked
        await wait_for(lambda: run.group.is_ready, START_TIMEOUT_S)
        assert [r.device_total for r in await run.group.step(EchoPayload(value=2))] == [4, 4]


@pytest.mark.parametrize(
    ("devices", "target", "init", "expected"),
    [
        (
            ("cpu", "cuda:3"),
            TARGET,
            EchoInit(),
            r"rank 1 \(cuda:3, pid \d+\) failed to start at device: RuntimeError: cuda:3: CUDA is "
            r"not available",
        ),
        (
            ("cpu", "cpu"),
            TARGET,
            EchoInit(fail_on_rank=1),
            r"rank 1 \(cpu, pid \d+\) failed to start at construct: MemoryError: injected out of "
            r"memory while loading",
        ),
        (
            ("cpu",),
            "tests.common.no_such_module:Step",
            EchoInit(),
            r"rank 0 \(cpu, pid \d+\) failed to start at import: ModuleNotFoundError: "
            r".*tests.common.no_such_module",
        ),
    ],
    ids=["bad-device", "constructor-raises", "import-error"],
)
async def test_a_rank_that_cannot_start_fails_the_start_naming_it(
    devices, target, init, expected
) -> None:
    readiness: list[bool] = []
    group = RankGroup(
        config(devices), StepSpec(target, EchoResult, init), on_ready_change=readiness.append
    )
    with pytest.raises(RankStartError, match=expected):
        await group.start()
    assert readiness == [] and group.state.value == "stopped"
    assert rank_children() == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
