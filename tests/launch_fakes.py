"""Helpers of the ``stageserve up`` tests: what ``start_all`` would start, without processes;
``up`` stopped where it would start the system (``run_up``); ``up`` as a process that refuses."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services import launcher as launcher_module
from services.launch_spec import ChildSpec, LaunchConfig, common_args, port_args
from services.launcher import Launcher
from tests.conftest import REPO


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
    monkeypatch.setattr(launcher, "wait_ready", lambda children, listening=False: None)
    launcher.start_all()
    return specs


def service_args(cfg: LaunchConfig, monkeypatch) -> dict[str, list[str]]:
    """The flags ``start_all`` gives each service, without starting any process."""
    return {spec.name: list(spec.args) for spec in _started_specs(cfg, monkeypatch)}


def started_ports(cfg: LaunchConfig, monkeypatch) -> dict[str, dict[str, int]]:
    """The ports ``start_all`` gives each service, without starting any process."""
    return {spec.name: dict(spec.ports) for spec in _started_specs(cfg, monkeypatch)}


def child_configs(cfg: LaunchConfig, monkeypatch) -> dict[str, Any]:
    """The config each model service and the first router would run with: its whole argv (the
    common flags, its ports, its own flags) parsed by the function its ``__main__`` uses."""
    from services.decode.__main__ import parse_config as parse_decode
    from services.prefill.__main__ import parse_args as parse_prefill
    from services.router import __main__ as router_main
    from services.vision_encoder.__main__ import parse_args as parse_encoder

    parsers: dict[str, Callable[[list[str]], Any]] = {
        "vision_encoder": parse_encoder,
        "prefill": parse_prefill,
        "decode": parse_decode,
        "router": lambda argv: router_main.config_from_args(
            router_main.build_parser().parse_args(argv)
        ),
    }
    return {
        spec.name: parsers[spec.name](
            [*common_args(cfg, spec.name), *port_args(spec.ports), *spec.args]
        )
        for spec in _started_specs(cfg, monkeypatch)
        if spec.name in parsers
    }


def recorded_configs(monkeypatch) -> list[LaunchConfig]:
    """The config of every ``up`` from now on; each stops there, answering 0."""
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env: configs.append(cfg) or 0)
    return configs


def fail_if_started(monkeypatch) -> None:
    """From now on an ``up`` that gets as far as starting the system fails the test."""
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env: pytest.fail("started"))


def assert_up_process_refuses(
    argv: list[str], env: dict[str, str], log_dir: Path, stderr: str
) -> None:
    """``python -m services.cli *argv --log-dir log_dir`` exits 2 saying exactly ``stderr``,
    and starts nothing."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv, "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == stderr
    assert done.stdout == "" and not log_dir.exists()  # nothing was started
