"""``stageserve up``: children get the internal token (and API key) in their environment, not
argv."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import services.launcher
from services.cli import main
from services.launch_spec import ChildSpec, LaunchConfig
from services.launcher import Launcher


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
    monkeypatch.setattr(services.launcher, "run_up", lambda cfg, env: pytest.fail("started"))
    assert main(["up", "--port", "0", "--transfer-backend", "shm", "--api-key", key]) == 2
    assert "API key" in capsys.readouterr().err
