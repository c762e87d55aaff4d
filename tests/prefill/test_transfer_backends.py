"""``--kv-transfer-backend``: prefill's KV sender and its embedding receiver pick their backends separately."""

from __future__ import annotations

import pytest

from services.common import kv_transfer
from services.prefill.__main__ import parse_args
from services.prefill.app import PrefillApp, rank_init
from tests.prefill.conftest import prefill_config

CHOICES = "mooncake, inprocess, cuda_ipc, shm"


def test_flag_parses_and_defaults_to_transfer_backend(monkeypatch) -> None:
    config = parse_args(["--kv-transfer-backend", "shm"])
    assert (config.transfer_backend, config.kv_transfer_backend, config.kv_backend) == (
        "mooncake",
        "shm",
        "shm",
    )
    assert parse_args([]).kv_transfer_backend is None
    assert parse_args([]).kv_backend == "mooncake"
    assert parse_args(["--transfer-backend", "shm"]).kv_backend == "shm"
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (
        parse_args(["--kv-transfer-backend", "cuda_ipc", "--device", "cuda"]).kv_backend
        == "cuda_ipc"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-transfer-backend", "nccl"],
            f"unknown KV transfer backend 'nccl'; supported: {CHOICES}",
        ),
        (
            ["--kv-transfer-backend", "rdma"],
            f"unknown KV transfer backend 'rdma'; supported: {CHOICES}",
        ),
        (
            ["--transfer-backend", "nccl"],
            "embedding transfer backend 'nccl' is not supported; supported: "
            "mooncake, inprocess, cuda_ipc, shm",
        ),
        (
            ["--transfer-backend", "cuda_ipc", "--kv-transfer-backend", "shm"],
            "the cuda_ipc embedding transfer backend moves rows between GPUs of one host and "
            "needs the vision encoder and prefill on CUDA devices, got 'cpu': use "
            "--transfer-backend shm",
        ),
        (["--kv-transfer-backend", "cuda_ipc"], "needs a CUDA device (--device cuda), got 'cpu'"),
        (
            ["--transfer-backend", "shm", "--device", "cuda:0"],
            "the shm KV transfer backend moves host memory "
            "and the KV pool is on 'cuda:0': use "
            "--kv-transfer-backend cuda_ipc",
        ),
        (["--transfer-backend", "inprocess"], "rank processes of their own"),
    ],
)
def test_unsupported_backends_are_rejected_at_startup(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["nccl", "rdma"])
def test_build_rejects_an_unsupported_kv_backend_before_starting_a_rank(name) -> None:
    with pytest.raises(ValueError, match=f"supported: {CHOICES}"):
        PrefillApp.build(prefill_config(kv_transfer_backend=name), internal_token="")


@pytest.mark.parametrize(("transfer", "kv"), [("inprocess", None), ("shm", "inprocess")])
def test_in_process_backends_are_refused_the_ranks_are_processes(transfer, kv) -> None:
    with pytest.raises(ValueError, match="rank processes of their own"):
        rank_init(prefill_config(transfer_backend=transfer, kv_transfer_backend=kv))


@pytest.mark.parametrize(
    ("transfer", "kv", "expected"),
    [
        ("mooncake", None, ("mooncake", "mooncake")),
        ("mooncake", "shm", ("mooncake", "shm")),
        ("shm", "mooncake", ("shm", "mooncake")),
        ("shm", "cuda_ipc", ("shm", "cuda_ipc")),
        ("cuda_ipc", None, ("cuda_ipc", "cuda_ipc")),
        ("cuda_ipc", "mooncake", ("cuda_ipc", "mooncake")),
    ],
)
def test_each_rank_builds_the_backends_chosen(monkeypatch, transfer, kv, expected) -> None:
    monkeypatch.setattr(
        kv_transfer, "mooncake_moves_device_memory", lambda: True
    )  # as with the CUDA build
    device = "cuda:0" if "cuda_ipc" in (transfer, kv) else "cpu"
    init = rank_init(
        prefill_config(transfer_backend=transfer, kv_transfer_backend=kv, devices=(device,))
    )
    assert (init.transfer_backend, init.kv_backend) == expected


def test_cuda_ipc_embeddings_need_every_cp_rank_on_a_gpu(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = parse_args(["--transfer-backend", "cuda_ipc", "--device", "cuda", "--ranks", "2"])
    assert (config.devices, config.transfer_backend, config.kv_backend) == (
        ("cuda:0", "cuda:1"),
        "cuda_ipc",
        "cuda_ipc",
    )
    with pytest.raises(ValueError, match="on CUDA devices, got 'cpu'"):
        rank_init(
            prefill_config(
                transfer_backend="cuda_ipc",
                kv_transfer_backend="mooncake",
                devices=("cuda:0", "cpu"),
            )
        )


def test_the_host_only_mooncake_build_is_refused_for_a_gpu_kv_pool(monkeypatch) -> None:
    # this machine has mooncake-transfer-engine-non-cuda: its TCP transport cannot read GPU memory
    assert not kv_transfer.mooncake_moves_device_memory()
    with pytest.raises(
        ValueError,
        match="moves host memory only and the KV pool is on 'cuda:1': use "
        "--kv-transfer-backend cuda_ipc",
    ):
        kv_transfer.check_kv_backend(None, "mooncake", "cuda:1")
    assert kv_transfer.check_kv_backend(None, "mooncake", "cpu") == "mooncake"
    assert kv_transfer.check_kv_backend("cuda_ipc", "mooncake", "cuda:1") == "cuda_ipc"
    monkeypatch.setattr(kv_transfer, "mooncake_moves_device_memory", lambda: True)
    assert kv_transfer.check_kv_backend(None, "mooncake", "cuda:1") == "mooncake"
