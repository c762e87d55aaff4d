"""``stageserve up``: children get the internal token (and API key) in their environment, not
argv."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import services.launcher
from services.cli import main
from services.launch_spec import ChildSpec, LaunchConfig, router_args
from services.launcher import Launcher
from tests.launch_fakes import assert_up_process_refuses, fail_if_started, recorded_configs


def test_every_child_gets_the_same_token_through_its_environment(monkeypatch) -> None:
    monkeypatch.delenv("STAGESERVE_INTERNAL_TOKEN")
    popens: list[tuple[list[str], dict[str, str]]] = []

    def popen(cmd, **kwargs):
        popens.append((cmd, kwargs["env"]))
        return SimpleNamespace(stdout=iter(()), pid=1)

    monkeypatch.setattr(services.launcher.subprocess, "Popen", popen)
    launcher = Launcher(LaunchConfig(Path("m")))
    launcher.start(ChildSpec("tokenizer", (), {"port": 0}))
    launcher.start(ChildSpec("decode", (), {"port": 0}))
    token = launcher.env["STAGESERVE_INTERNAL_TOKEN"]
    assert len(token) >= 43  # secrets.token_urlsafe(32)
    assert [env["STAGESERVE_INTERNAL_TOKEN"] for _, env in popens] == [token, token]
    assert all(token not in " ".join(cmd) for cmd, _ in popens)
    assert popens[0][1]["PATH"] == os.environ["PATH"]  # the rest of our environment is kept
    assert (
        Launcher(LaunchConfig(Path("m"))).env["STAGESERVE_INTERNAL_TOKEN"] != token
    )  # fresh per launcher


def test_up_passes_the_api_key_and_keeps_an_existing_token(monkeypatch) -> None:
    envs: list[dict[str, str]] = []
    monkeypatch.setattr(services.launcher, "run_up", lambda cfg, env: envs.append(dict(env)) or 0)
    assert main(["up", "--port", "0", "--transfer-backend", "shm", "--api-key", "sk-up"]) == 0
    assert envs[0]["STAGESERVE_API_KEY"] == "sk-up"
    assert envs[0]["STAGESERVE_INTERNAL_TOKEN"] == os.environ["STAGESERVE_INTERNAL_TOKEN"]
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 0
    assert "STAGESERVE_API_KEY" not in envs[1]


@pytest.mark.parametrize("key", ["", "two words"])
def test_up_refuses_an_unusable_api_key_before_starting_anything(monkeypatch, capsys, key) -> None:
    fail_if_started(monkeypatch)
    assert main(["up", "--port", "0", "--transfer-backend", "shm", "--api-key", key]) == 2
    assert "API key" in capsys.readouterr().err


def test_up_process_refuses_every_interface_without_an_api_key(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STAGESERVE_API_KEY"}
    assert_up_process_refuses(
        ["up", "--host", "0.0.0.0", "--port", "0"],
        env,
        tmp_path / "logs",
        "error: the API would listen on 0.0.0.0 (not loopback only) without an API key: set one "
        "with --api-key or STAGESERVE_API_KEY, or pass --insecure-no-api-key to serve it open "
        "on purpose",
    )


def router_flags(monkeypatch, argv: list[str]) -> tuple[str, ...] | None:
    """The router's flags ``up argv`` would start it with (None: ``up`` refused)."""
    configs = recorded_configs(monkeypatch)
    if main(["up", "--port", "0", "--transfer-backend", "shm", *argv]) != 0:
        return None
    return router_args(configs[0], tokenizer="t", prefill="p", decode="d", encoder="e")


def test_up_serves_every_interface_with_a_key_or_on_purpose(monkeypatch, capsys) -> None:
    monkeypatch.delenv("STAGESERVE_API_KEY", raising=False)
    assert router_flags(monkeypatch, ["--host", "0.0.0.0"]) is None
    assert "--insecure-no-api-key" in capsys.readouterr().err
    with_key = router_flags(monkeypatch, ["--host", "0.0.0.0", "--api-key", "sk-up"])
    assert with_key is not None and "--insecure-no-api-key" not in with_key
    insecure = router_flags(monkeypatch, ["--host", "0.0.0.0", "--insecure-no-api-key"])
    assert insecure is not None and insecure[-1] == "--insecure-no-api-key"
    assert router_flags(monkeypatch, ["--host", "::1"]) is not None  # loopback: no key needed
    monkeypatch.setenv("STAGESERVE_API_KEY", "sk-env")
    from_env = router_flags(monkeypatch, ["--host", "0.0.0.0"])
    assert from_env is not None and "--insecure-no-api-key" not in from_env


@pytest.mark.parametrize(
    "backends",
    [
        ["--transfer-backend", "mooncake"],
        ["--kv-transfer-backend", "mooncake"],
        ["--transfer-backend", "mooncake", "--kv-transfer-backend", "shm"],
    ],
)
def test_up_refuses_mooncake_on_a_loopback_host(monkeypatch, capsys, backends) -> None:
    fail_if_started(monkeypatch)
    assert main(["up", "--port", "0", *backends]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the mooncake transfer backend cannot stay on --host 127.0.0.1")
    assert "listens on every interface" in err and "use shm" in err


def test_up_warns_of_mooncakes_ports_on_another_host(monkeypatch, capsys) -> None:
    configs = recorded_configs(monkeypatch)
    argv = ["up", "--port", "0", "--host", "0.0.0.0", "--api-key", "sk-up"]
    assert main([*argv, "--transfer-backend", "mooncake"]) == 0
    assert configs[0].transfer_backend == "mooncake"
    err = capsys.readouterr().err
    assert err.startswith("warning: Mooncake 0.3.13 listens on every interface")
    assert main([*argv, "--transfer-backend", "shm"]) == 0
    assert "Mooncake" not in capsys.readouterr().err
