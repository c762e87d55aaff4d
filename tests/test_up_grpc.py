"""``stageserve up --grpc-port`` and ``--enable-reflection``: the first router's gRPC port and
reflection on every router, from the command line to the router's own config."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import build_parser
from services.common.paths import BUNDLED_MODEL
from services.common.settings import config_from_args
from services.launch_config import LaunchConfig
from tests.launch_fakes import child_configs, service_args, started_ports


def test_the_flags_reach_the_launch_config() -> None:
    args = build_parser().parse_args(["up", "--grpc-port", "50051", "--enable-reflection"])
    cfg = config_from_args(LaunchConfig, args, model=args.model.resolve())
    assert (cfg.grpc_port, cfg.enable_reflection) == (50051, True)
    default = build_parser().parse_args(["up"])
    cfg = config_from_args(LaunchConfig, default, model=default.model.resolve())
    assert (cfg.grpc_port, cfg.enable_reflection) == (0, False)


def test_the_first_router_binds_the_grpc_port_and_every_router_reflects(monkeypatch) -> None:
    cfg = LaunchConfig(BUNDLED_MODEL, grpc_port=50051, enable_reflection=True, router_workers=2)
    ports = started_ports(cfg, monkeypatch)
    assert ports["router"]["port"] == 50051
    assert ports["router-2"]["port"] == 0  # gRPC ports are not shared: a free one
    assert all(ports[name]["port"] == 0 for name in ("tokenizer", "decode", "prefill"))
    args = service_args(cfg, monkeypatch)
    assert [n for n, a in args.items() if "--enable-reflection" in a] == ["router", "router-2"]
    router = child_configs(cfg, monkeypatch)["router"]
    assert (router.port, router.enable_reflection) == (50051, True)


def test_without_the_flags_the_router_takes_a_free_port_and_no_reflection(monkeypatch) -> None:
    cfg = LaunchConfig(Path("m"))
    assert started_ports(cfg, monkeypatch)["router"]["port"] == 0
    assert not any("--enable-reflection" in a for a in service_args(cfg, monkeypatch).values())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"grpc_port": 8000, "http_port": 8000}, "--grpc-port and --port are both 8000"),
        (
            {"grpc_port": 9002, "metrics_port_base": 9000},
            "ports 9000-9004, which include the gRPC port 9002",
        ),
    ],
)
def test_a_grpc_port_another_port_takes_is_refused(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchConfig(Path("m"), **settings)
