"""``--ranks`` / ``--devices`` / ``--cp-block-tokens`` / ``--cp-min-tokens``: parsed into one device
per CP rank, and bad values are a startup error naming the value."""

from __future__ import annotations

import pytest

from services.prefill.__main__ import parse_args
from tests.conftest import TINY_MODEL_DIR


def test_ranks_and_devices_give_one_device_per_rank(monkeypatch) -> None:
    import torch

    assert parse_args([]).devices == ("cpu",)
    assert parse_args(["--ranks", "3"]).devices == ("cpu", "cpu", "cpu")
    assert parse_args(
        ["--devices", "cuda:0,cuda:1", "--kv-transfer-backend", "cuda_ipc"]
    ).devices == ("cuda:0", "cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = parse_args(["--ranks", "2", "--device", "cuda", "--kv-transfer-backend", "cuda_ipc"])
    assert config.devices == ("cuda:0", "cuda:1") and config.num_ranks == 2
    config = parse_args(["--cp-block-tokens", "1", "--cp-min-tokens", "512"])
    assert (config.cp_block_tokens, config.cp_min_tokens) == (1, 512)
    assert parse_args([]).cp_block_tokens == 64 and parse_args([]).cp_min_tokens == 2048


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cp-block-tokens", "24"],
            "--cp-block-tokens 24 must be 1 or a positive multiple of --page-size 16",
        ),
        (["--cp-block-tokens", "0"], "--cp-block-tokens 0 must be 1 or a positive multiple"),
        (["--cp-block-tokens", "-16"], "--cp-block-tokens -16 must be 1 or a positive multiple"),
        (
            ["--ranks", "3", "--devices", "cuda:0,cuda:1"],
            "--ranks 3 disagrees with the 2 --devices 'cuda:0,cuda:1'",
        ),
        (["--ranks", "4", "--device", "cuda"], "--ranks 4 needs 4 GPUs; this host has 0"),
        (
            ["--ranks", "2", "--device", "cuda:1"],
            "--ranks 2 with device cuda:1: name each rank's GPU (prefill --devices)",
        ),
        (["--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
        (["--cp-min-tokens", "0"], "argument --cp-min-tokens: must be >= 1, got 0"),
    ],
)
def test_bad_cp_flags_are_startup_errors_naming_the_value(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_tp_and_ep_split_the_rank_processes() -> None:
    config = parse_args(["--ranks", "4", "--tp", "2", "--kv-transfer-backend", "shm"])
    assert (config.num_ranks, config.cp_size, config.tp, config.ep) == (4, 2, 2, 1)
    moe = str(TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe")
    config = parse_args(
        ["--model", moe, "--ranks", "2", "--tp", "2", "--ep", "2", "--transfer-backend", "shm"]
    )
    assert (config.cp_size, config.ep) == (1, 2)
    config = parse_args(["--model", moe, "--ranks", "2", "--ep", "2", "--transfer-backend", "shm"])
    assert (config.cp_size, config.tp, config.ep) == (2, 1, 2)  # experts over the CP ranks


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "3", "--tp", "2"], "prefill --tp 2 does not divide its 3 rank processes"),
        (["--ranks", "3", "--tp", "3"], "tensor parallel size 3 does not divide the 4 attention"),
        (
            [
                *("--ranks", "2", "--tp", "2", "--transfer-backend", "shm"),
                *("--kv-store-master", "127.0.0.1:50051"),
            ],
            "--kv-store-master with --tp 2: the shared store keeps whole pages",
        ),
        (["--ranks", "2", "--ep", "2"], "expert parallel size 2 on a dense model: no experts"),
        (
            ["--model", "MOE", "--ranks", "4", "--ep", "2"],
            "splits the experts over the CP ranks: prefill --ep must then equal their number, 4",
        ),
        (
            ["--model", "MOE", "--ranks", "2", "--ep", "4"],
            "splits the experts over the CP ranks: prefill --ep must then equal their number, 2",
        ),
        (["--model", "MOE", "--ranks", "3", "--ep", "3"], "size 3 does not divide the 8 experts"),
        (
            ["--model", "MOE", "--ranks", "4", "--tp", "2", "--ep", "4"],
            "expert parallel size 4 with tensor parallel size 2",
        ),
        (["--ranks", "2", "--tp", "2", "--ep", "2"], "expert parallel size 2 on a dense model"),
        (
            ["--model", "MOE", "--ranks", "2", "--tp", "2"],
            "tensor parallel size 2 on an MoE model needs expert parallel size 2",
        ),
    ],
)
def test_bad_tp_flags_are_startup_errors_naming_the_numbers(argv, message, capsys) -> None:
    moe = str(TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe")
    with pytest.raises(SystemExit) as exc:
        parse_args([moe if a == "MOE" else a for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_experts_over_cp_ranks_that_share_a_gpu_are_refused() -> None:
    from services.prefill.config import PrefillConfig, check_parallel

    moe = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
    config = PrefillConfig(model=moe, devices=("cuda:0", "cuda:0"), ep=2)
    with pytest.raises(ValueError, match="prefill --ep 2 over CP ranks that share a CUDA device"):
        check_parallel(config)
    check_parallel(PrefillConfig(model=moe, devices=("cuda:0", "cuda:1"), ep=2))
