"""One registry of transfer backends: both families' constructors, capabilities, spec kwargs."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from services.common import kv_transfer
from services.common.kv_transfer import (
    BACKENDS,
    ROLES,
    TransferSpec,
    check_cross_process,
    check_embedding_backend,
    check_kv_backend,
    default_embedding_backend,
    default_kv_backend,
)
from services.transfer import (
    BaseEmbeddingReceiver,
    BaseEmbeddingSender,
    BaseKVReceiver,
    BaseKVSender,
    create_embedding_receiver,
    create_kv_sender,
)

BASES = {
    "kv_sender": BaseKVSender,
    "kv_receiver": BaseKVReceiver,
    "embedding_sender": BaseEmbeddingSender,
    "embedding_receiver": BaseEmbeddingReceiver,
}


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("role", ROLES)
def test_every_entry_names_a_class_of_its_role_and_backend(name, role) -> None:
    module, cls = getattr(BACKENDS[name], role).split(":")
    factory = getattr(importlib.import_module(f"services.transfer.{module}"), cls)
    assert issubclass(factory, BASES[role]) and factory.backend == name


@pytest.mark.parametrize("role", ROLES)
def test_the_spec_reaches_mooncake_only(role) -> None:
    staging = {"staging_rows": 5} if role == "embedding_sender" else {}
    spec = TransferSpec("mooncake", host="h", protocol="rdma", staging_rows=5)
    assert BACKENDS["mooncake"].kwargs(spec, role) == {
        "hostname": "h",
        "protocol": "rdma",
        **staging,
    }
    for name in ("inprocess", "cuda_ipc", "shm"):
        assert BACKENDS[name].kwargs(TransferSpec(name, host="h"), role) == {}


def test_a_spec_builds_the_backend_it_names() -> None:
    sender = create_kv_sender(TransferSpec("shm", host="h"))  # no hostname for shm
    receiver = create_embedding_receiver(TransferSpec("inprocess"), cp_rank=3)
    try:
        assert (sender.backend, receiver.backend, receiver.cp_rank) == ("shm", "inprocess", 3)
    finally:
        sender.close()
        receiver.close()


def test_a_backend_module_is_imported_only_when_created() -> None:
    code = (
        "import sys; from services.transfer import create_kv_sender; "
        "create_kv_sender('shm').close(); "
        "print(sorted(m for m in sys.modules if m.startswith('services.transfer.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "services.transfer.shm_backend" in out
    assert "mooncake" not in out and "cuda_ipc" not in out


def test_the_checks_follow_the_capability_flags(monkeypatch) -> None:
    monkeypatch.setattr(kv_transfer, "mooncake_moves_device_memory", lambda: True)
    for name, backend in BACKENDS.items():
        for device in ("cpu", "cuda:0"):
            kind = kv_transfer.device_type(device)
            if kind in backend.kv_devices:
                assert check_kv_backend(name, "shm", device) == name
            else:
                with pytest.raises(ValueError, match=f"the {name} KV transfer backend"):
                    check_kv_backend(name, "shm", device)
        gpu_only = "cpu" not in backend.buffer_devices
        assert check_embedding_backend(name, ("cuda:0", "cuda:1")) == name
        if gpu_only:
            with pytest.raises(ValueError, match="use --transfer-backend shm"):
                check_embedding_backend(name, ("cuda:0", "cpu"))
        else:
            assert check_embedding_backend(name, ("cuda:0", "cpu")) == name
    with pytest.raises(ValueError, match="within one process, and they are apart: use one of "):
        check_cross_process("inprocess", "they are apart")
    check_cross_process("shm", "they are apart")
    check_cross_process("carrier-pigeon", "they are apart")  # its family's check names it


def test_the_host_only_mooncake_build_names_the_cuda_one(monkeypatch) -> None:
    monkeypatch.setattr(kv_transfer, "mooncake_moves_device_memory", lambda: False)
    with pytest.raises(ValueError, match="or install mooncake-transfer-engine \\(the CUDA build"):
        check_kv_backend("mooncake", "shm", "cuda:0")
    assert check_kv_backend("mooncake", "shm", "cpu") == "mooncake"


@pytest.mark.parametrize(
    ("encoder", "prefill", "expected"),
    [
        ("cuda:0", "cuda:1", "cuda_ipc"),
        ("cuda:0", "cuda:0", "cuda_ipc"),
        ("cpu", "cuda:1", "shm"),
        ("cpu", "cpu", "shm"),
    ],
)
def test_up_defaults_the_embedding_backend(encoder, prefill, expected) -> None:
    assert default_embedding_backend(encoder, prefill) == expected


def test_up_defaults_the_kv_backend_to_the_memory_of_both_ends() -> None:
    assert default_kv_backend(("cuda:0", "cuda:1", "cuda:1")) == "cuda_ipc"
    assert default_kv_backend(("cpu", "cpu")) == "shm"
    with pytest.raises(ValueError, match="use --kv-transfer-backend mooncake"):
        default_kv_backend(("cuda:0", "cpu"))


def test_the_help_lists_every_backend() -> None:
    for name, backend in BACKENDS.items():
        assert f"{name} = {backend.summary}" in kv_transfer.KV_BACKEND_HELP
