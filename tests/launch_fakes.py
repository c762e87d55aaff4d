"""Helpers of the ``stageserve up`` tests: what ``start_all`` would start, without processes."""

from __future__ import annotations

from types import SimpleNamespace

from services.launch_spec import ChildSpec, LaunchConfig
from services.launcher import Launcher


def service_args(cfg: LaunchConfig, monkeypatch) -> dict[str, list[str]]:
    """The flags ``start_all`` gives each service, without starting any process."""
    started: dict[str, list[str]] = {}

    def start(spec: ChildSpec) -> SimpleNamespace:
        started[spec.name] = list(spec.args)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1"
        )

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return started


def started_ports(cfg: LaunchConfig, monkeypatch) -> dict[str, dict[str, int]]:
    """The ports ``start_all`` gives each service, without starting any process."""
    ports: dict[str, dict[str, int]] = {}

    def start(spec: ChildSpec) -> SimpleNamespace:
        ports[spec.name] = dict(spec.ports)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1"
        )

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return ports
