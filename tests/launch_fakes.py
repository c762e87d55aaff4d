"""Helpers of the ``stageserve up`` tests: what ``start_all`` would start, without processes."""

from __future__ import annotations

from types import SimpleNamespace

from services.launch_spec import ChildSpec, LaunchConfig
from services.launcher import Launcher


def _started_specs(cfg: LaunchConfig, monkeypatch) -> list[ChildSpec]:
    """The child specs ``start_all`` starts, in order, without starting any process."""
    specs: list[ChildSpec] = []

    def start(spec: ChildSpec) -> SimpleNamespace:
        specs.append(spec)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1"
        )

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return specs


def service_args(cfg: LaunchConfig, monkeypatch) -> dict[str, list[str]]:
    """The flags ``start_all`` gives each service, without starting any process."""
    return {spec.name: list(spec.args) for spec in _started_specs(cfg, monkeypatch)}


def started_ports(cfg: LaunchConfig, monkeypatch) -> dict[str, dict[str, int]]:
    """The ports ``start_all`` gives each service, without starting any process."""
    return {spec.name: dict(spec.ports) for spec in _started_specs(cfg, monkeypatch)}
