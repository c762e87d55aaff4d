"""``stageserve up --device cuda``: what it chooses on a fake CUDA device list (no GPU here),
what each service is started with, and what it refuses before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import launcher as launcher_module
from services.cli import main
from services.cli_up_defaults import RankLayout, UpFlags, decode_memory_fraction, resolve_up
from services.launch_spec import LaunchConfig
from tests.launch_fakes import service_args

ONE_GPU = RankLayout(("cuda:0",), ("cuda:0",), ("cuda:0",))
THREE_GPUS = RankLayout(("cuda:0",), ("cuda:1",), ("cuda:2",))

SEVEN_B_CONFIG = Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen2.5-vl-7b"


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_one_gpu_gets_cuda_ipc_flashinfer_and_decode_the_rest_of_the_share() -> None:
    chosen = resolve_up(ONE_GPU, UpFlags(), num_cuda_devices=1, has_flashinfer=True)
    assert (chosen.transfer_backend, chosen.kv_transfer_backend) == ("cuda_ipc", "cuda_ipc")
    assert chosen.attention_backend == "flashinfer" and chosen.attention_note == ""
    assert chosen.decode_memory_fraction == pytest.approx(0.85 - 0.3 - 0.05)
    line = chosen.describe(ONE_GPU, UpFlags())
    assert "attention flashinfer" in line and "decode CUDA graphs on" in line


def test_without_flashinfer_attention_is_torch_and_the_line_says_why() -> None:
    chosen = resolve_up(THREE_GPUS, UpFlags(), num_cuda_devices=3, has_flashinfer=False)
    assert chosen.attention_backend == "torch"
    assert "flashinfer is not installed" in chosen.describe(THREE_GPUS, UpFlags())
    assert chosen.decode_memory_fraction == 0.85  # decode alone on cuda:2


def test_the_cpu_keeps_shm_torch_and_decodes_own_page_count() -> None:
    cpu = RankLayout(("cpu",), ("cpu",), ("cpu",))
    chosen = resolve_up(cpu, UpFlags(), num_cuda_devices=0, has_flashinfer=True)
    assert (chosen.transfer_backend, chosen.kv_transfer_backend) == ("shm", "shm")
    assert chosen.attention_backend == "torch" and chosen.decode_memory_fraction is None


def test_decode_ranks_on_a_shared_gpu_split_what_prefill_and_the_encoder_leave() -> None:
    layout = RankLayout(("cuda:0", "cuda:0"), ("cuda:0",), ("cuda:0", "cuda:1"))
    assert decode_memory_fraction(layout, 0.9) == pytest.approx(0.9 - 0.3 - 2 * 0.05)
    with pytest.raises(ValueError, match="leaves decode nothing on cuda:0"):
        decode_memory_fraction(layout, 0.35)


@pytest.mark.parametrize(
    ("flags", "num_gpus", "has_flashinfer", "message"),
    [
        (UpFlags(), 0, True, "this host has 0 CUDA device"),
        (UpFlags(attention_backend="flashinfer"), 1, False, "flashinfer is not installed"),
        (UpFlags(num_pages=8, gpu_memory_utilization=0.5), 1, True, "give one"),
    ],
)
def test_what_cannot_work_is_refused_with_the_reason(flags, num_gpus, has_flashinfer, message):
    with pytest.raises(ValueError, match=message):
        resolve_up(ONE_GPU, flags, num_gpus, has_flashinfer)


def test_flashinfer_on_the_cpu_is_refused() -> None:
    layout = RankLayout(("cuda:0",), ("cuda:0",), ("cpu",))
    with pytest.raises(ValueError, match="runs on CUDA devices only"):
        resolve_up(layout, UpFlags("shm", "mooncake", "flashinfer"), 1, True)


def _up(monkeypatch, argv: list[str], num_gpus: int = 1) -> LaunchConfig:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    monkeypatch.setattr("services.engine.gpu_defaults.flashinfer_importable", lambda: True)
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", *argv]) == 0
    return configs[0]


def test_up_device_cuda_starts_every_service_with_what_works_on_the_gpu(monkeypatch, capsys):
    _up(monkeypatch, ["--device", "cuda"])  # the bundled model is float32: no flashinfer
    assert "attention torch (flashinfer runs bfloat16 or float16" in capsys.readouterr().err
    seven_b = ["--model", str(SEVEN_B_CONFIG)]  # bfloat16, head size 128 (config only)
    cfg = _up(monkeypatch, ["--device", "cuda", *seven_b])
    assert "attention flashinfer; KV transfer cuda_ipc" in capsys.readouterr().err
    args = service_args(cfg, monkeypatch)
    for name in ("prefill", "decode"):
        assert _flag(args[name], "--attention-backend") == "flashinfer"
        assert _flag(args[name], "--kv-transfer-backend") == "cuda_ipc"
    assert _flag(args["vision_encoder"], "--transfer-backend") == "cuda_ipc"
    assert _flag(args["decode"], "--gpu-memory-utilization") == "0.5"
    assert _flag(args["decode"], "--num-pages") is None


def test_up_takes_sglangs_flag_and_a_page_count(monkeypatch) -> None:
    argv = ["--device", "cuda:0", "--decode-device", "cuda:1"]
    cfg = _up(monkeypatch, [*argv, "--mem-fraction-static", "0.75"], num_gpus=2)
    assert cfg.decode_memory_fraction == 0.75  # decode alone on cuda:1
    cfg = _up(monkeypatch, [*argv, "--num-pages", "4096"], num_gpus=2)
    args = service_args(cfg, monkeypatch)
    assert _flag(args["decode"], "--num-pages") == "4096"
    assert _flag(args["decode"], "--gpu-memory-utilization") is None


def test_up_refuses_a_gpu_the_host_does_not_have(monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["up", "--port", "0", "--device", "cuda:0", "--decode-device", "cuda:1"]) == 2
    assert "device 'cuda:1': this host has 1 CUDA device" in capsys.readouterr().err


def test_auto_attention_takes_torch_for_a_float32_model_and_says_why() -> None:
    chosen = resolve_up(
        ONE_GPU, UpFlags(), num_cuda_devices=1, has_flashinfer=True, dtype="float32"
    )
    assert chosen.attention_backend == "torch"
    assert "float32" in chosen.describe(ONE_GPU, UpFlags())
    bf16 = resolve_up(ONE_GPU, UpFlags(), num_cuda_devices=1, has_flashinfer=True, dtype="bfloat16")
    assert bf16.attention_backend == "flashinfer"


def test_flashinfer_asked_for_a_float32_model_is_refused_with_the_reason() -> None:
    flags = UpFlags(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="bfloat16 or float16.*float32"):
        resolve_up(ONE_GPU, flags, num_cuda_devices=1, has_flashinfer=True, dtype="float32")


def test_auto_attention_takes_torch_for_a_head_size_flashinfer_has_no_kernels_for() -> None:
    chosen = resolve_up(ONE_GPU, UpFlags(), 1, True, dtype="bfloat16", head_dim=16)
    assert chosen.attention_backend == "torch"
    assert "head size 16" in chosen.describe(ONE_GPU, UpFlags())
