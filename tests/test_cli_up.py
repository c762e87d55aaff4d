"""``stageserve up``: ``--kv-transfer-backend`` parsed, checked, and passed to prefill and decode only when
set; per-service devices."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from services.cli import build_parser, main
from services.launcher import LaunchConfig, Launcher, common_args


def service_args(cfg: LaunchConfig, monkeypatch) -> dict[str, list[str]]:
    """The flags ``start_all`` gives each service, without starting any process."""
    started: dict[str, list[str]] = {}

    def start(name: str, extra_args: list[str]) -> SimpleNamespace:
        started[name] = extra_args
        return SimpleNamespace(name=name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1")

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return started


def test_up_parses_the_flag() -> None:
    assert build_parser().parse_args(["up"]).kv_transfer_backend is None
    assert build_parser().parse_args(["up", "--kv-transfer-backend", "cuda_ipc"]).kv_transfer_backend == "cuda_ipc"


@pytest.mark.parametrize("name", ["nccl", "rdma"])
def test_up_rejects_other_names(name, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-transfer-backend", name])
    assert "choose from mooncake, inprocess, cuda_ipc" in capsys.readouterr().err.replace("'", "")


def test_up_rejects_cuda_ipc_on_the_cpu_before_starting_anything(capsys) -> None:
    assert main(["up", "--kv-transfer-backend", "cuda_ipc"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_kv_flag_reaches_prefill_and_decode_only_when_set(monkeypatch) -> None:
    args = service_args(LaunchConfig(Path("m"), transfer_backend="mooncake", kv_transfer_backend="cuda_ipc"),
                        monkeypatch)
    for name in ("prefill", "decode"):
        assert args[name][:4] == ["--transfer-backend", "mooncake", "--kv-transfer-backend", "cuda_ipc"]
    assert args["vision_encoder"] == ["--transfer-backend", "mooncake"]
    args = service_args(LaunchConfig(Path("m"), transfer_backend="inprocess"), monkeypatch)
    assert not any("--kv-transfer-backend" in a for a in args.values())
    assert args["prefill"][:2] == args["decode"][:2] == ["--transfer-backend", "inprocess"]


def test_each_model_service_can_get_its_own_device() -> None:
    args = build_parser().parse_args(["up", "--device", "cuda:0", "--decode-device", "cuda:1"])
    assert (args.device, args.encoder_device, args.prefill_device, args.decode_device) == ("cuda:0", None, None,
                                                                                           "cuda:1")
    cfg = LaunchConfig(Path("m"), device="cuda:0", decode_device="cuda:1", encoder_device="cuda:2")

    def device(name: str) -> str:
        flags = common_args(cfg, name)
        return flags[flags.index("--device") + 1]

    assert [device(n) for n in ("tokenizer", "vision_encoder", "prefill", "decode", "router")] == [
        "cuda:0", "cuda:2", "cuda:0", "cuda:1", "cuda:0"]


def test_up_checks_the_kv_backend_against_both_ends_devices(capsys) -> None:
    assert main(["up", "--device", "cuda:0", "--decode-device", "cpu", "--kv-transfer-backend", "cuda_ipc"]) == 2
    assert "needs a CUDA device (--device cuda), got 'cpu'" in capsys.readouterr().err
    assert main(["up", "--prefill-device", "cuda:1", "--kv-transfer-backend", "mooncake"]) == 2  # -non-cuda build
    assert "moves host memory only and the KV pool is on 'cuda:1'" in capsys.readouterr().err
