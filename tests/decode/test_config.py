"""Decode's DP flags: ``--ranks D`` on ``--device``, or one rank per ``--devices`` entry."""

from __future__ import annotations

import pytest

from services.decode.__main__ import parse_config


def test_ranks_and_devices_give_each_rank_its_device() -> None:
    assert parse_config([]).devices == ("cpu",)
    assert parse_config(["--ranks", "3"]).devices == ("cpu",) * 3
    assert parse_config(
        ["--ranks", "2", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"]
    ).devices == ("cuda:0", "cuda:0")
    config = parse_config(["--devices", "cuda:0,cuda:1", "--kv-transfer-backend", "cuda_ipc"])
    assert config.devices == ("cuda:0", "cuda:1")
    assert parse_config(
        ["--devices", "cuda:0,cuda:1", "--ranks", "2", "--kv-transfer-backend", "cuda_ipc"]
    )
    assert parse_config(["--ranks", "2", "--dp-attention"]).dp_attention


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
        (["--ranks", "3", "--devices", "cpu,cpu"], "--ranks 3 disagrees with the 2 --devices"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
        # the KV backend is checked against every rank's device
        (["--kv-transfer-backend", "cuda_ipc", "--devices", "cpu,cuda:1"], "needs a CUDA device"),
        # DP attention: one process per DP rank, the MLP and experts split over every rank
        (["--ranks", "4", "--tp", "2", "--dp-attention"], "--dp-attention with --tp 2"),
        (["--ranks", "2", "--ep", "2", "--dp-attention"], "expert parallel size 2 on a dense"),
        (["--ranks", "3", "--dp-attention"], "DP attention over 3 does not divide the inter"),
        (
            ["--ranks", "2", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"]
            + ["--dp-attention"],
            "decode --dp-attention on ranks that share a CUDA device",
        ),
    ],
)
def test_bad_rank_flags_are_refused_at_start(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_config(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_devices_must_name_cpu_or_cuda_devices(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--devices", "tpu:0"])
    assert "expected cpu or cuda:N" in capsys.readouterr().err
