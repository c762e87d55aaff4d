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
