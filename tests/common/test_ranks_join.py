"""Ranks that join their group from another host (``join`` devices, ``stageserve join-rank``),
as real processes on CPU (gloo): the joined rank listens on an address of its own (127.0.0.2,
as a pod's IP), steps with the spawned rank over an encrypted TCP control channel, and a joined
rank that dies or freezes fails the group's step for every caller and re-joins the next
formation; a rank with another token never joins."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

from services.common.envs import INTERNAL_TOKEN_ENV
from services.common.errors import UnavailableError
from services.common.ranks.errors import RankStartError
from tests.common.ranks_group_helpers import (
    TOKEN,
    agent_ranks,
    control_address,
    is_gone,
    join_agent,
    running,
    wait_for,
)
from tests.common.test_ranks_steps import EchoPayload

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_env")]
JOINED_HOST = "127.0.0.2"  # another loopback address: the joined rank's own interface
LIVENESS_S = 3.0
REJOIN_S = 120.0  # a new rank process imports torch on a loaded 2-core machine


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)  # the leader's and the joined rank's


def join_config(leader: str) -> dict:
    return dict(
        control_addr=leader,
        host="127.0.0.1",
        internal_token=TOKEN,
        heartbeat_s=0.5,
        liveness_timeout_s=LIVENESS_S,
        leader_timeout_s=5.0,
    )


async def test_a_joined_rank_steps_dies_freezes_and_rejoins(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="services.common.ranks.supervisor")
    leader = control_address()
    with join_agent(leader, JOINED_HOST) as agent:
        async with running(("cpu", "join"), **join_config(leader)) as run:
            results = await run.group.step(EchoPayload(value=3))
            assert [(r.rank, r.device_total, r.cpu_total) for r in results] == [
                (0, 6, 6),
                (1, 6, 6),
            ]
            [joined] = agent_ranks(agent)
            with open(f"/proc/{joined}/cmdline", "rb") as f:
                assert f"\0--host\0{JOINED_HOST}\0".encode() in f.read()
            assert len(run.group.rank_pids) == 1  # the leader spawned rank 0 only

            # dies: the next step fails for its caller, naming the rank; a new process rejoins
            os.kill(joined, signal.SIGKILL)
            with pytest.raises(UnavailableError, match="rank"):
                await run.group.step(EchoPayload(value=1), timeout_s=10.0)
            await wait_for(lambda: run.group.is_ready, REJOIN_S)
            results = await run.group.step(EchoPayload(value=2))
            assert [r.device_total for r in results] == [4, 4]
            [rejoined] = agent_ranks(agent)
            assert rejoined != joined

            # freezes while idle: silent past the liveness bound, the group fails; the leader
            # cannot kill it on its host, so it rejoins once it runs again (and sees Shutdown)
            os.kill(rejoined, signal.SIGSTOP)
            await wait_for(lambda: not run.group.is_ready, LIVENESS_S + 10.0)
            reasons = [r.getMessage() for r in caplog.records if "fail-stop" in r.getMessage()]
            assert re.search(
                rf"rank 1 \(joining, cpu, pid {rejoined} on its host\) answered no ping",
                reasons[-1],
            ), reasons
            os.kill(rejoined, signal.SIGCONT)
            await wait_for(lambda: is_gone(rejoined), 30.0)
            await wait_for(lambda: run.group.is_ready, REJOIN_S)
            results = await run.group.step(EchoPayload(value=5))
            assert [r.device_total for r in results] == [10, 10]


async def test_a_rank_with_another_token_never_joins(caplog) -> None:
    """The control channel's keys come from the token: the handshake fails, so no Hello ever
    reaches the leader (not even one to refuse), and the group's start fails naming the joining
    rank, after the start timeout rather than rank 0's rendezvous timeout."""
    caplog.set_level(logging.WARNING, logger="services.common.ranks.supervisor")
    leader = control_address()
    with join_agent(leader, JOINED_HOST, token="another token"):
        with pytest.raises(RankStartError, match=r"no Hello from ranks \[1\] \(joining"):
            async with running(("cpu", "join"), start_timeout_s=12.0, **join_config(leader)):
                pass
    assert not [
        r for r in caplog.records if "Hello" in r.getMessage() and "refused" in r.getMessage()
    ]


async def test_the_join_agent_refuses_what_cannot_join(monkeypatch) -> None:
    from services.common.ranks.join import build_parser, check_args

    def problem(*argv: str) -> str | None:
        return check_args(build_parser().parse_args(["--host", "10.0.0.2", *argv]))

    ok = ["--leader", "tcp://10.0.0.1:29600", "--world-size", "4"]
    assert problem(*ok, "--rank", "3") is None
    assert "rank 0 runs beside its leader" in problem(*ok, "--rank", "0")
    assert "1 .. 3" in problem(*ok, "--rank", "4")
    assert "tcp://HOST:PORT" in problem("--leader", "ipc:///x", "--world-size", "2", "--rank", "1")
    monkeypatch.delenv(INTERNAL_TOKEN_ENV)
    assert "no internal token" in problem(*ok, "--rank", "1")


async def test_join_settings_the_group_refuses() -> None:
    from services.common.ranks.config import RankGroupConfig

    def refused(**fields) -> str:
        with pytest.raises(ValueError) as caught:
            RankGroupConfig(**{"devices": ("cpu", "join"), "internal_token": TOKEN, **fields})
        return str(caught.value)

    good = {"control_addr": "tcp://10.0.0.1:29600", "host": "10.0.0.1"}
    RankGroupConfig(devices=("cpu", "join"), internal_token=TOKEN, **good)
    assert "tcp://HOST:PORT" in refused()
    assert "one address" in refused(control_addr="tcp://10.0.0.1:29600", host="10.0.0.9")
    assert "fixed port" in refused(control_addr="tcp://10.0.0.1:0", host="10.0.0.1")
    assert "never a wildcard" in refused(control_addr="tcp://0.0.0.0:29600", host="0.0.0.0")
    assert "internal token" in refused(**good, internal_token="")
    assert "devices[0]" in refused(**good, devices=("join", "cpu"))
    with pytest.raises(ValueError, match="must be loopback"):
        RankGroupConfig(devices=("cpu",), host="10.0.0.1")


def test_the_leader_takes_a_joining_ranks_hello_for_the_formation_forming() -> None:
    from services.common.ranks.config import RankGroupConfig
    from services.common.ranks.formation import Formation
    from services.common.ranks.messages import ANY_FORMATION, Hello

    config = RankGroupConfig(
        devices=("cpu", "join"),
        control_addr="tcp://10.0.0.1:29600",
        host="10.0.0.1",
        internal_token=TOKEN,
    )
    gen = Formation(3, config, deadline_mono=0.0)

    def hello(rank: int, formation: int, device: str = "cpu", token: str = TOKEN) -> Hello:
        return Hello(rank, 2, formation, 4242, device, 0, token)

    assert gen.hello_problem(hello(1, ANY_FORMATION)) is None
    assert gen.hello_problem(hello(1, 3)) is None
    assert "expected 3 (or -1)" in gen.hello_problem(hello(1, 2))
    assert "brings cuda:0; the group's ranks run on cpu" in gen.hello_problem(
        hello(1, ANY_FORMATION, "cuda:0")
    )
    assert "token does not match" in gen.hello_problem(hello(1, ANY_FORMATION, token="x"))
    assert "expected 3" in gen.hello_problem(hello(0, ANY_FORMATION))  # rank 0 is spawned
    assert gen.take_hello(b"peer", hello(1, ANY_FORMATION)) is None
    assert gen.members[1].who == "rank 1 (joining, cpu, pid 4242 on its host)"
    assert "said Hello already" in gen.hello_problem(hello(1, ANY_FORMATION))
    assert gen.needing_setup() == []  # rank 0's Hello (its store) has not come
