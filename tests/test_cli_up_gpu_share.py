"""``stageserve up`` and the GPU share file: prefill and decode get it when they share one
device (by default on CUDA, on request elsewhere), never otherwise, and ``up`` removes it."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from services import launcher as launcher_module
from services.cli import main
from services.launch_spec import LaunchConfig, with_gpu_share
from tests.launch_fakes import service_args


def _value(args: list[str], flag: str) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args) if a == flag]
    assert len(values) <= 1
    return values[0] if values else None


def test_prefill_and_decode_on_one_cuda_device_share_a_file(monkeypatch, tmp_path) -> None:
    cfg = with_gpu_share(LaunchConfig(Path("m"), device="cuda", log_dir=tmp_path))
    assert cfg.gpu_share_file is not None and cfg.gpu_share_file.parent == tmp_path
    args = service_args(cfg, monkeypatch)
    assert _value(args["prefill"], "--gpu-share-file") == str(cfg.gpu_share_file)
    assert _value(args["decode"], "--gpu-share-file") == str(cfg.gpu_share_file)
    assert _value(args["decode"], "--prefill-first-ms") is None  # decode's own default
    assert all(_value(args[name], "--gpu-share-file") is None for name in ("router", "tokenizer"))

    same = LaunchConfig(Path("m"), prefill_device="cuda:1", decode_device="cuda:1")
    given = with_gpu_share(replace(same, prefill_first_ms=40.0))
    assert _value(service_args(given, monkeypatch)["decode"], "--prefill-first-ms") == "40.0"
    off = with_gpu_share(replace(same, prefill_first_ms=0.0))
    assert off.gpu_share_file is None  # 0: off
    assert _value(service_args(off, monkeypatch)["decode"], "--prefill-first-ms") is None


def test_no_file_unless_one_device_holds_every_prefill_and_decode_rank(tmp_path) -> None:
    cpu = LaunchConfig(Path("m"), log_dir=tmp_path)
    assert with_gpu_share(cpu).gpu_share_file is None  # the CPU: only on request
    assert with_gpu_share(replace(cpu, prefill_first_ms=20.0)).gpu_share_file is not None
    apart = [
        LaunchConfig(Path("m"), device="cuda:0", decode_device="cuda:1"),
        LaunchConfig(Path("m"), device="cuda", decode_device="cuda:0,cuda:1"),
        LaunchConfig(Path("m"), device="cuda", prefill_cp=2),
    ]
    for cfg in apart:
        assert with_gpu_share(cfg).gpu_share_file is None
        with pytest.raises(ValueError, match="--prefill-first-ms needs prefill and decode on one"):
            with_gpu_share(replace(cfg, prefill_first_ms=50.0))


def test_up_takes_the_flag_and_removes_the_file_when_it_stops(monkeypatch, tmp_path) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    argv = ["up", "--port", "0", "--transfer-backend", "shm", "--log-dir", str(tmp_path)]
    assert main([*argv, "--prefill-first-ms", "20"]) == 0
    assert main(argv) == 0
    given, default = configs
    assert given.prefill_first_ms == 20.0 and given.gpu_share_file is not None
    assert default.gpu_share_file is None
    with pytest.raises(SystemExit):  # argparse: a negative bound
        main([*argv, "--prefill-first-ms", "-1"])

    given.gpu_share_file.write_bytes(bytes(512))
    launcher_module.Launcher(given, {}, threading.Event()).stop_all()
    assert not given.gpu_share_file.exists()
