"""``stageserve up``'s process layouts: fixed metrics ports, vision encoder ranks, decode DP
ranks and router workers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from services import launch_config
from services import launcher as launcher_module
from services.cli import main
from services.launch_spec import ChildSpec, LaunchConfig, common_args
from services.launcher import Launcher
from tests.launch_fakes import service_args, started_ports


def test_metrics_port_base_gives_each_service_a_fixed_metrics_port(monkeypatch) -> None:
    ports = started_ports(LaunchConfig(Path("m"), metrics_port_base=9100), monkeypatch)
    assert {name: p["metrics_port"] for name, p in ports.items()} == {
        "tokenizer": 9100,
        "vision_encoder": 9101,
        "decode": 9103,
        "prefill": 9102,
        "router": 9104,
    }
    assert all(p["port"] == 0 for p in ports.values()) and ports["router"]["http_port"] == 8000
    defaults = started_ports(LaunchConfig(Path("m")), monkeypatch)
    assert all(p["metrics_port"] == 0 for p in defaults.values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics-port-base", "65533"], "--metrics-port-base must be in [1, 65531], got 65533"),
        (["--metrics-port-base", "0"], "--metrics-port-base must be in [1, 65531], got 0"),
        (["--port", "9102", "--metrics-port-base", "9100"], "include the HTTP port 9102"),
    ],
)
def test_up_checks_the_metrics_port_base(argv, message, capsys) -> None:
    assert main(["up", "--port", "0", "--transfer-backend", "shm", *argv]) == 2
    assert message in capsys.readouterr().err


def test_encoder_ranks_reach_the_vision_encoder_only_when_given(monkeypatch, capsys) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", "--encoder-ranks", "2"]) == 0
    assert configs[0].encoder_ranks == 2
    args = service_args(configs[0], monkeypatch)
    assert args["vision_encoder"] == ["--transfer-backend", "shm", "--ranks", "2"]
    # decode: its DP ranks; prefill: its CP ranks
    assert [n for n, a in args.items() if "--ranks" in a] == ["vision_encoder", "decode", "prefill"]
    assert args["prefill"][args["prefill"].index("--ranks") + 1] == "1"
    assert "--ranks" not in service_args(LaunchConfig(Path("m")), monkeypatch)["vision_encoder"]
    assert main(["up", "--port", "0", "--encoder-ranks", "0"]) == 2
    assert "--encoder-ranks must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------ DP decode and router workers


def test_decode_dp_and_router_workers_reach_their_processes(monkeypatch) -> None:
    specs: list[ChildSpec] = []

    def start(spec: ChildSpec) -> SimpleNamespace:
        specs.append(spec)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "8123"}, address="127.0.0.1:1"
        )

    launcher = Launcher(LaunchConfig(Path("m"), decode_dp=3, router_workers=3, http_port=0))
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children, listening=False: None)
    launcher.start_all()
    by_name = {spec.name: spec for spec in specs}
    decode = list(by_name["decode"].args)
    assert decode[decode.index("--ranks") + 1] == "3"
    routers = [spec for spec in specs if spec.module == "services.router"]
    assert [spec.name for spec in routers] == ["router", "router-2", "router-3"]
    assert all("--http-reuse-port" in spec.args for spec in routers)
    assert [spec.ports["http_port"] for spec in routers] == [
        0,
        8123,
        8123,
    ]  # the first one's port, shared
    assert routers[1].args == routers[0].args
    single = service_args(LaunchConfig(Path("m")), monkeypatch)
    assert (
        "--http-reuse-port" not in single["router"]
        and single["decode"][single["decode"].index("--ranks") + 1] == "1"
    )


def test_router_workers_default_to_the_machine_size() -> None:
    assert [launch_config.default_router_workers(n) for n in (1, 2, 8, 16, 31, 64, 256)] == [
        1,
        1,
        1,
        2,
        3,
        4,
        4,
    ]


def test_up_takes_decode_dp_and_router_workers(monkeypatch, capsys) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", "--decode-dp", "2", "--router-workers", "3"]) == 0
    assert main(["up", "--port", "0"]) == 0
    (given, default) = configs
    assert (given.decode_dp, given.router_workers) == (2, 3)
    assert (default.decode_dp, default.router_workers) == (
        1,
        launch_config.default_router_workers(),
    )
    for flag in ("--decode-dp", "--router-workers"):
        with pytest.raises(SystemExit) as exc:
            main(["up", flag, "0"])
        assert exc.value.code == 2
        assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_a_decode_device_list_puts_one_rank_on_each(monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # cuda:0 and cuda:1
    cfg = LaunchConfig(Path("m"), device="cuda:0", decode_device="cuda:0,cuda:1")
    args = service_args(cfg, monkeypatch)
    assert args["decode"][args["decode"].index("--devices") + 1] == "cuda:0,cuda:1"
    assert "--ranks" not in args["decode"]
    flags = common_args(cfg, "decode")
    assert flags[flags.index("--device") + 1] == "cuda:0"
    assert (
        main(
            [
                "up",
                "--device",
                "cuda:0",
                "--decode-device",
                "cuda:0,cuda:1",
                "--decode-dp",
                "3",
                "--kv-transfer-backend",
                "cuda_ipc",
            ]
        )
        == 2
    )
    assert "--decode-dp 3 disagrees with --decode-device (2 devices)" in capsys.readouterr().err
    assert (
        main(
            [
                "up",
                "--device",
                "cuda:0",
                "--decode-device",
                "cuda:1,cpu",
                "--kv-transfer-backend",
                "cuda_ipc",
            ]
        )
        == 2
    )  # every rank's device is checked against the KV backend
    assert "needs a CUDA device" in capsys.readouterr().err
