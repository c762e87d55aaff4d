"""Decode's DP flags: ``--ranks D`` on ``--device``, or one rank per ``--devices`` entry."""

from __future__ import annotations

import pytest

from services.decode.config import parse_config


def test_ranks_and_devices_give_each_rank_its_device() -> None:
    assert parse_config([]).rank_devices == ("cpu",)
    assert parse_config(["--ranks", "3"]).rank_devices == ("cpu",) * 3
    assert parse_config(
        ["--ranks", "2", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"]
    ).rank_devices == ("cuda:0", "cuda:0")
    config = parse_config(["--devices", "cuda:0,cuda:1", "--kv-transfer-backend", "cuda_ipc"])
    assert config.rank_devices == ("cuda:0", "cuda:1")
    assert parse_config(
        ["--devices", "cuda:0,cuda:1", "--ranks", "2", "--kv-transfer-backend", "cuda_ipc"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "--ranks must be > 0"),
        (
            ["--ranks", "3", "--devices", "cpu,cpu"],
            "--ranks 3 disagrees with --devices (2 devices)",
        ),
        # the KV backend is checked against every rank's device
        (["--kv-transfer-backend", "cuda_ipc", "--devices", "cpu,cuda:1"], "needs a CUDA device"),
    ],
)
def test_bad_rank_flags_are_refused_at_start(argv, message) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_config(argv)
    assert message in str(caught.value.code)


def test_devices_must_name_cpu_or_cuda_devices(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--devices", "tpu:0"])
    assert "expected cpu or cuda:N" in capsys.readouterr().err
