"""``--kv-transfer-backend``: prefill's KV sender and its embedding receiver pick their backends separately."""

from __future__ import annotations

import os
from typing import Any

import pytest

from services.common import kv_transfer
from services.prefill import app as prefill_app
from services.prefill.__main__ import parse_args
from services.prefill.app import PrefillApp, build_embedding_receiver, build_kv_sender
from services.transfer.inprocess_backend import InProcessKVSender
from services.transfer.shm_backend import ShmKVSender
from services.transfer.shm_memory import SHM_DIR, decode_session_id
from tests.prefill.conftest import prefill_config

CHOICES = "mooncake, inprocess, cuda_ipc, shm"


def test_flag_parses_and_defaults_to_transfer_backend() -> None:
    config = parse_args(["--kv-transfer-backend", "inprocess"])
    assert (config.transfer_backend, config.kv_transfer_backend, config.kv_backend) == ("mooncake", "inprocess",
                                                                                         "inprocess")
    assert parse_args([]).kv_transfer_backend is None
    assert parse_args([]).kv_backend == "mooncake"
    assert parse_args(["--transfer-backend", "inprocess"]).kv_backend == "inprocess"
    assert parse_args(["--kv-transfer-backend", "cuda_ipc", "--device", "cuda"]).kv_backend == "cuda_ipc"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-transfer-backend", "nccl"], f"torch.distributed group spanning prefill and decode, which the "
                                            f"services do not build; supported: {CHOICES}"),
        (["--kv-transfer-backend", "rdma"], f"unknown KV transfer backend 'rdma'; supported: {CHOICES}"),
        (["--transfer-backend", "nccl"], "embedding transfer backend 'nccl' is not supported; supported: "
                                         "mooncake, inprocess, shm"),
        (["--transfer-backend", "cuda_ipc", "--device", "cuda"], "embedding transfer backend 'cuda_ipc'"),
        (["--kv-transfer-backend", "cuda_ipc"], "needs a CUDA device (--device cuda), got 'cpu'"),
        (["--transfer-backend", "shm", "--device", "cuda"], "the shm KV transfer backend moves host memory and "
                                                            "the KV pool is on 'cuda': use --kv-transfer-backend "
                                                            "cuda_ipc"),
    ],
)
def test_unsupported_backends_are_rejected_at_startup(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["nccl", "rdma"])
def test_build_rejects_an_unsupported_kv_backend_before_loading_the_model(name) -> None:
    with pytest.raises(ValueError, match=f"supported: {CHOICES}"):
        PrefillApp.build(prefill_config(kv_transfer_backend=name))  # no model given: the check comes first


@pytest.mark.parametrize(("kv", "sender_type"), [("inprocess", InProcessKVSender), ("shm", ShmKVSender)])
def test_kv_sender_uses_the_kv_backend(kv, sender_type) -> None:
    sender = build_kv_sender(prefill_config(transfer_backend="mooncake", kv_transfer_backend=kv))
    try:
        assert isinstance(sender, sender_type)
    finally:
        sender.close()


def record_factories(monkeypatch) -> list[tuple[str, str, dict[str, Any]]]:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    monkeypatch.setattr(prefill_app, "create_kv_sender", lambda name, **kw: calls.append(("kv", name, kw)))
    monkeypatch.setattr(prefill_app, "create_embedding_receiver",
                        lambda name, **kw: calls.append(("embedding", name, kw)))
    return calls


@pytest.mark.parametrize(
    ("transfer", "kv", "expected"),
    [
        ("mooncake", None, [("kv", "mooncake", {"hostname": "h"}), ("embedding", "mooncake", {"hostname": "h"})]),
        ("mooncake", "inprocess", [("kv", "inprocess", {}), ("embedding", "mooncake", {"hostname": "h"})]),
        ("inprocess", "mooncake", [("kv", "mooncake", {"hostname": "h"}), ("embedding", "inprocess", {})]),
        ("mooncake", "cuda_ipc", [("kv", "cuda_ipc", {}), ("embedding", "mooncake", {"hostname": "h"})]),
        ("shm", "cuda_ipc", [("kv", "cuda_ipc", {}), ("embedding", "shm", {})]),
    ],
)
def test_mooncake_hostname_goes_only_to_mooncake_endpoints(monkeypatch, transfer, kv, expected) -> None:
    monkeypatch.setattr(kv_transfer, "mooncake_moves_device_memory", lambda: True)  # as with the CUDA build
    calls = record_factories(monkeypatch)
    config = prefill_config(transfer_backend=transfer, kv_transfer_backend=kv, transfer_hostname="h", device="cuda")
    build_kv_sender(config)
    build_embedding_receiver(config)
    assert calls == expected


def test_the_host_only_mooncake_build_is_refused_for_a_gpu_kv_pool(monkeypatch) -> None:
    # this machine has mooncake-transfer-engine-non-cuda: its TCP transport cannot read GPU memory
    assert not kv_transfer.mooncake_moves_device_memory()
    with pytest.raises(ValueError, match="moves host memory only and the KV pool is on 'cuda:1': use "
                                         "--kv-transfer-backend cuda_ipc"):
        kv_transfer.check_kv_backend(None, "mooncake", "cuda:1")
    assert kv_transfer.check_kv_backend(None, "mooncake", "cpu") == "mooncake"
    assert kv_transfer.check_kv_backend("cuda_ipc", "mooncake", "cuda:1") == "cuda_ipc"
    monkeypatch.setattr(kv_transfer, "mooncake_moves_device_memory", lambda: True)
    assert kv_transfer.check_kv_backend(None, "mooncake", "cuda:1") == "mooncake"


def test_shm_embedding_buffer_lives_in_the_segment(language_model) -> None:
    app = PrefillApp.build(prefill_config(transfer_backend="shm"), model=language_model)
    receiver = app.embedding_receiver
    try:
        ref = decode_session_id(receiver.session_id)
        buffer = receiver.buffer
        assert ref.base_address == buffer.base_address and buffer.tensor.device.type == "cpu"
        assert os.stat(os.path.join(SHM_DIR, ref.name)).st_size == buffer.num_bytes
        assert isinstance(app.kv_sender, ShmKVSender)
    finally:
        app.kv_sender.close()
        receiver.close()
    assert not os.path.exists(os.path.join(SHM_DIR, ref.name))
