"""Prefill's flags for a rank group that spans hosts: ``--devices`` with 'join' ranks and
``--rank-address``; what the service refuses, the group it builds, and the address a joined
rank's transfer engines advertise."""

from __future__ import annotations

import pytest

from services.common.ranks.step import RankContext
from services.decode.__main__ import parse_config as parse_decode
from services.prefill.__main__ import parse_args
from services.prefill.app import group_config, rank_init
from services.prefill.rank_step import transfer_hostname

JOIN = ["--devices", "cpu,join,join", "--rank-address", "10.0.0.1:29600"]


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_a_group_with_joining_ranks_listens_on_the_rank_address() -> None:
    config = parse_args([*JOIN, "--transfer-backend", "mooncake", "--transfer-host", "10.0.0.1"])
    group = group_config(config, internal_token="t")
    assert group.devices == ("cpu", "join", "join") and group.joining == (1, 2)
    assert (group.control_addr, group.host) == ("tcp://10.0.0.1:29600", "10.0.0.1")
    spawned = parse_args(["--devices", "cpu,cpu", "--transfer-backend", "shm"])
    assert group_config(spawned, internal_token="t").host == "127.0.0.1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "cpu,join"], "--rank-address HOST:PORT names where they find their group"),
        (["--devices", "cpu", "--rank-address", "10.0.0.1:1"], "--devices has none"),
        (["--devices", "join,cpu"], "never the first"),
        ([*JOIN[:2], "--rank-address", "10.0.0.1"], "must be HOST:PORT"),
        ([*JOIN[:2], "--rank-address", "0.0.0.0:29600"], "not a wildcard"),
        ([*JOIN, "--transfer-backend", "shm"], "moves data within one host"),
        (
            [*JOIN, "--transfer-backend", "mooncake", "--kv-transfer-backend", "shm"],
            "the shm transfer backend moves data within one host, and prefill has ranks on "
            "other hosts ('join' devices): use mooncake",
        ),
    ],
)
def test_what_cannot_span_hosts_is_refused(argv, message, capsys) -> None:
    assert message in refusal(argv, capsys)


def test_only_prefill_takes_join_devices(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_decode(["--devices", "cpu,join"])
    assert "expected cpu or cuda:N" in capsys.readouterr().err


def test_a_joined_rank_advertises_its_own_address() -> None:
    init = rank_init(parse_args([*JOIN, "--transfer-host", "10.0.0.1"]))
    spawned = RankContext(0, 3, "cpu", None, None, 10.0, "10.0.0.1")
    joined = RankContext(1, 3, "cpu", None, None, 10.0, "10.0.0.7", joined=True)
    assert transfer_hostname(spawned, init) == "10.0.0.1"
    assert transfer_hostname(joined, init) == "10.0.0.7"
