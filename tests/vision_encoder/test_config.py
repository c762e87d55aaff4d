"""The encoder's ``--transfer-backend``: cuda_ipc on CUDA ranks only; inprocess never (its ranks are
processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.vision_encoder.__main__ import parse_args
from services.vision_encoder.config import VisionEncoderConfig


def test_cuda_ipc_is_taken_when_every_rank_is_on_a_gpu() -> None:
    config = VisionEncoderConfig(
        model=Path("m"), devices=("cuda:0", "cuda:1"), transfer_backend="cuda_ipc"
    )
    assert config.transfer_backend == "cuda_ipc"


@pytest.mark.parametrize("devices", [("cpu",), ("cuda:0", "cpu")])
def test_cuda_ipc_is_refused_for_a_rank_off_the_gpu(devices) -> None:
    with pytest.raises(
        ValueError,
        match="the cuda_ipc embedding transfer backend moves rows between GPUs of one "
        "host .* got 'cpu': use --transfer-backend shm",
    ):
        VisionEncoderConfig(model=Path("m"), devices=devices, transfer_backend="cuda_ipc")


def test_the_command_line_refuses_cuda_ipc_on_the_cpu(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--transfer-backend", "cuda_ipc", "--allow-unauthenticated"])
    assert exc.value.code == 2
    assert (
        "needs the vision encoder and prefill on CUDA devices, got 'cpu'" in capsys.readouterr().err
    )


def test_inprocess_is_refused() -> None:
    with pytest.raises(
        ValueError, match="sends rows through mooncake, cuda_ipc, shm, got 'inprocess'"
    ):
        VisionEncoderConfig(model=Path("m"), transfer_backend="inprocess")


def test_tp_groups_adjacent_processes_into_each_rank() -> None:
    from services.common.envs import Envs
    from services.vision_encoder.app import rank_group_configs

    config = parse_args(["--ranks", "4", "--tp", "2", "--allow-unauthenticated"])
    assert (config.num_ranks, config.tp) == (2, 2)
    devices = "cuda:0,cuda:1,cuda:0,cuda:1"  # two ranks may share GPUs: their groups are apart
    config = parse_args(["--devices", devices, "--tp", "2", "--allow-unauthenticated"])
    groups = rank_group_configs(config, Envs())
    assert [g.devices for g in groups] == [("cuda:0", "cuda:1")] * 2


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ranks", "3", "--tp", "2"], "--tp 2 does not divide its 3 rank processes"),
        (["--devices", "cuda:0,cuda:0", "--tp", "2"], "share a CUDA device (cuda:0, cuda:0)"),
        (["--devices", "cuda:0,cpu", "--tp", "2"], "on CPU and CUDA processes at once"),
        (["--ranks", "4", "--tp", "4"], "size 4 does not divide the 2 vision attention heads"),
    ],
)
def test_the_command_line_refuses_a_tp_that_cannot_run(capsys, flags, named) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args([*flags, "--allow-unauthenticated"])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
