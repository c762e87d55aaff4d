"""``--kv-transfer-backend``: decode's KV receiver, chosen apart from ``--transfer-backend``."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from services.common import kv_transfer
from services.common.kv_transfer import BACKENDS, TransferSpec
from services.decode import rank as rank_module
from services.decode.__main__ import parse_config
from services.decode.app import rank_init
from services.decode.config import DecodeConfig
from services.decode.rank import build_rank, create_receiver
from services.transfer.inprocess_backend import InProcessKVReceiver
from services.transfer.shm_backend import ShmKVReceiver
from services.transfer.shm_memory import SHM_DIR, decode_session_id
from tests.decode.conftest import BASE_CONFIG

CHOICES = "mooncake, inprocess, cuda_ipc, shm"


def test_flag_parses_and_defaults_to_transfer_backend() -> None:
    config = parse_config(["--kv-transfer-backend", "inprocess"])
    assert (config.transfer_backend, config.kv_transfer_backend, config.kv_backend) == (
        "mooncake",
        "inprocess",
        "inprocess",
    )
    assert parse_config([]).kv_transfer_backend is None
    assert parse_config([]).kv_backend == "mooncake"
    assert parse_config(["--transfer-backend", "inprocess"]).kv_backend == "inprocess"
    assert (
        parse_config(["--kv-transfer-backend", "cuda_ipc", "--device", "cuda:1"]).kv_backend
        == "cuda_ipc"
    )
    assert parse_config(["--transfer-backend", "shm"]).kv_backend == "shm"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-transfer-backend", "nccl"],
            f"unknown KV transfer backend 'nccl'; supported: {CHOICES}",
        ),
        (["--transfer-backend", "nccl"], f"supported: {CHOICES}"),
        (
            ["--kv-transfer-backend", "rdma"],
            f"unknown KV transfer backend 'rdma'; supported: {CHOICES}",
        ),
        (["--kv-transfer-backend", "cuda_ipc"], "needs a CUDA device (--device cuda), got 'cpu'"),
        (
            ["--kv-transfer-backend", "shm", "--device", "cuda:1"],
            "the shm KV transfer backend moves host memory "
            "and the KV pool is on 'cuda:1': use "
            "--kv-transfer-backend cuda_ipc",
        ),
    ],
)
def test_unsupported_backends_are_rejected_at_startup(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["nccl", "rdma"])
def test_build_rejects_an_unsupported_kv_backend_before_loading_the_model(name) -> None:
    config = replace(BASE_CONFIG, kv_transfer_backend=name)
    with pytest.raises(ValueError, match=f"supported: {CHOICES}"):
        rank_init(config)  # what every rank is built from: no rank starts, no model loads


@pytest.mark.parametrize(
    ("kv", "receiver_type"), [("inprocess", InProcessKVReceiver), ("shm", ShmKVReceiver)]
)
def test_kv_backend_beside_a_mooncake_transfer_backend(kv, receiver_type) -> None:
    receiver = create_receiver(
        rank_init(DecodeConfig(transfer_backend="mooncake", kv_transfer_backend=kv))
    )
    try:
        assert isinstance(receiver, receiver_type)
    finally:
        receiver.close()


def test_shm_engine_keeps_its_pool_in_the_segment(language_model) -> None:
    rank = build_rank(
        rank_init(replace(BASE_CONFIG, kv_transfer_backend="shm")), "cpu", language_model
    )
    try:
        pool = rank.loop.batch.runner.kv_pool
        ref = decode_session_id(rank.receiver.session_id)
        (k_addr, k_bytes), (v_addr, v_bytes) = pool.memory_regions()
        assert ref.base_address == k_addr and v_addr == k_addr + k_bytes
        assert os.stat(os.path.join(SHM_DIR, ref.name)).st_size == k_bytes + v_bytes
        assert [t.data_ptr() for t in pool.k_cache] == [
            k_addr + i * k_bytes // pool.num_layers for i in range(pool.num_layers)
        ]
    finally:
        rank.receiver.close()
    assert not os.path.exists(os.path.join(SHM_DIR, ref.name))


@pytest.mark.parametrize(
    ("transfer", "kv", "expected"),
    [
        ("mooncake", None, ("mooncake", {"hostname": "h", "protocol": "tcp"})),
        ("inprocess", "mooncake", ("mooncake", {"hostname": "h", "protocol": "tcp"})),
        ("mooncake", "inprocess", ("inprocess", {})),
        ("mooncake", "cuda_ipc", ("cuda_ipc", {})),
    ],
)
def test_mooncake_hostname_only_for_a_mooncake_kv_backend(
    monkeypatch, transfer, kv, expected
) -> None:
    monkeypatch.setattr(
        kv_transfer, "mooncake_moves_device_memory", lambda: True
    )  # as with the CUDA build
    calls: list[tuple[str, dict[str, Any]]] = []

    def create(spec: TransferSpec, **kwargs: Any) -> None:  # what the registry passes the class
        calls.append(
            (spec.backend, {**BACKENDS[spec.backend].kwargs(spec, "kv_receiver"), **kwargs})
        )

    monkeypatch.setattr(rank_module, "create_kv_receiver", create)
    config = DecodeConfig(
        transfer_backend=transfer, kv_transfer_backend=kv, transfer_host="h", device="cuda"
    )
    create_receiver(rank_init(config))
    assert calls == [expected]


def test_cuda_ipc_on_a_cpu_device_fails_at_build(language_model) -> None:
    init = rank_init(replace(BASE_CONFIG, kv_transfer_backend="cuda_ipc"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_rank(init, "cpu", language_model)
    receiver = create_receiver(init)
    assert receiver.backend == "cuda_ipc"
    with pytest.raises(ValueError, match="needs a CUDA KV pool"):  # the pool itself is on the CPU
        build_rank(init, "cpu", language_model, receiver)
