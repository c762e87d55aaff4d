"""``stageserve up --prefill-cp C``: prefill gets ``--ranks C`` (and its CP flags when given); a
value
prefill could not start with is an error before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.launch_spec import LaunchConfig
from tests.test_cli_up import service_args


def test_prefill_gets_its_ranks_and_cp_flags(monkeypatch) -> None:
    args = service_args(LaunchConfig(Path("m"), prefill_cp=2), monkeypatch)["prefill"]
    assert args[args.index("--ranks") + 1] == "2"
    assert "--cp-block-tokens" not in args and "--cp-min-tokens" not in args
    cfg = LaunchConfig(Path("m"), prefill_cp=3, prefill_cp_block_tokens=32, prefill_cp_min_tokens=1)
    args = service_args(cfg, monkeypatch)["prefill"]
    assert args[args.index("--ranks") + 1] == "3"
    assert (
        args[args.index("--cp-block-tokens") + 1] == "32"
        and args[args.index("--cp-min-tokens") + 1] == "1"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--prefill-cp", "3", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"],
            "--prefill-cp 3 needs 3 GPUs; this host has 0",
        ),
        (
            [
                "--prefill-cp",
                "2",
                "--prefill-device",
                "cuda:1",
                "--kv-transfer-backend",
                "cuda_ipc",
            ],
            "--prefill-cp 2 with device cuda:1: name each rank's GPU",
        ),
        (
            ["--prefill-cp", "2", "--prefill-cp-block-tokens", "20"],
            "--cp-block-tokens 20 must be 1 or a positive multiple of --page-size 16",
        ),
    ],
)
def test_a_prefill_cp_prefill_cannot_run_is_refused_before_starting_anything(
    argv, message, capsys
) -> None:
    assert main(["up", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_prefill_cp_below_one_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--prefill-cp", "0"])
    assert exc.value.code == 2
    assert "argument --prefill-cp: must be >= 1, got 0" in capsys.readouterr().err


def test_prefill_gets_its_tp_and_ep(monkeypatch) -> None:
    cfg = LaunchConfig(Path("m"), prefill_cp=2, prefill_tp=2, prefill_ep=2)
    args = service_args(cfg, monkeypatch)["prefill"]
    assert args[args.index("--ranks") + 1] == "4"  # every process: CP ranks x TP ranks
    assert args[args.index("--tp") + 1] == "2" and args[args.index("--ep") + 1] == "2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-tp", "3"], "tensor parallel size 3 does not divide the 4 attention heads"),
        (
            ["--prefill-tp", "2", "--kv-transfer-backend", "mooncake"],
            "--prefill-tp 2 and --decode-tp 1 hold different KV heads per rank, and the mooncake "
            "KV backend moves whole pages",
        ),
        (["--decode-tp", "3"], "tensor parallel size 3 does not divide the 4 attention heads"),
        (["--decode-tp", "2", "--decode-ep", "2"], "expert parallel size 2 on a dense model"),
        (["--prefill-ep", "2"], "expert parallel size 2 with tensor parallel size 1"),
        (
            ["--prefill-tp", "2", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"],
            "--prefill-cp x --prefill-tp 2 needs 2 GPUs; this host has 0",
        ),
    ],
)
def test_a_prefill_tp_prefill_cannot_run_is_refused_before_starting_anything(
    argv, message, capsys
) -> None:
    assert main(["up", *argv]) == 2
    assert message in capsys.readouterr().err
