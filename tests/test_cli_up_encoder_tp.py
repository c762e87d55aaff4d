"""``stageserve up --encoder-tp``: the vision encoder's ``--tp``, checked before anything starts
(``--encoder-ranks`` counts every process, as the encoder's ``--ranks`` does)."""

from __future__ import annotations

import pytest

from services import launcher as launcher_module
from services.cli import main
from services.launch_spec import LaunchConfig
from tests.launch_fakes import service_args


def test_encoder_tp_reaches_the_vision_encoder(monkeypatch) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", "--encoder-ranks", "4", "--encoder-tp", "2"]) == 0
    args = service_args(configs[0], monkeypatch)["vision_encoder"]
    assert args[args.index("--tp") + 1] == "2" and args[args.index("--ranks") + 1] == "4"
    assert "--tp" not in service_args(LaunchConfig(configs[0].model), monkeypatch)["vision_encoder"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encoder-tp", "2"], "--tp 2 does not divide its 1 rank processes"),
        (["--encoder-ranks", "4", "--encoder-tp", "4"], "does not divide the 2 vision attention"),
    ],
)
def test_up_refuses_an_encoder_tp_that_cannot_run(argv, message, capsys) -> None:
    assert main(["up", "--port", "0", "--transfer-backend", "shm", *argv]) == 2
    assert message in capsys.readouterr().err
