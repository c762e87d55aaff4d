"""The system and image TTFT benchmarks' ``--config``: the 7B stays the default (its checkpoint
directory and section title unchanged), another config gets its own checkpoint directory and a
section title naming it, and a single-GPU layout that cannot hold both models' weights and
decode's KV pool is refused before anything is built."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import image_ttft, system, system_memory
from benchmarks.precision import Precision
from benchmarks.random_model import CONFIG_7B
from benchmarks.report import write_run_section
from benchmarks.system_model import default_checkpoint_dir, section_title
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, FP8, FP8_E4M3, NO_QUANTIZATION

CONFIG_8B = "benchmarks/configs/qwen3-vl-8b"
TMP = Path(tempfile.gettempdir())
MODULES = [
    pytest.param(system, "benchmarks.system", "System", id="system"),
    pytest.param(image_ttft, "benchmarks.image_ttft", "Image TTFT", id="image_ttft"),
]


@pytest.mark.parametrize(("module", "name", "heading"), MODULES)
def test_the_7b_config_is_the_default_with_its_old_checkpoint_and_title(module, name, heading):
    args = module._parse([])
    assert args.config == CONFIG_7B
    assert args.checkpoint_dir == TMP / "stageserve-7b-random"
    assert section_title(module.SECTION_TITLE, heading, name, args.config) == module.SECTION_TITLE
    explicit = module._parse(["--config", str(CONFIG_7B)])  # the same config, spelled out
    assert explicit.checkpoint_dir == TMP / "stageserve-7b-random"


@pytest.mark.parametrize(("module", "name", "heading"), MODULES)
def test_another_config_gets_its_own_checkpoint_and_a_title_naming_it(module, name, heading):
    args = module._parse(["--config", CONFIG_8B, "--out", ""])
    assert args.checkpoint_dir == TMP / "stageserve-qwen3-vl-8b-random"
    title = section_title(module.SECTION_TITLE, heading, name, args.config)
    assert title == (
        f"## {heading} at qwen3-vl-8b dimensions (`python -m {name} --config {CONFIG_8B}`)"
    )
    absolute = module._parse(["--config", str(Path(CONFIG_8B).resolve()) + "/"])
    assert section_title(module.SECTION_TITLE, heading, name, absolute.config) == title
    assert absolute.checkpoint_dir == args.checkpoint_dir
    mine = module._parse(["--config", CONFIG_8B, "--checkpoint-dir", "/data/ckpt"])
    assert mine.checkpoint_dir == Path("/data/ckpt")  # the flag still wins


@pytest.mark.parametrize(("module", "name", "heading"), MODULES)
def test_a_config_dir_without_a_config_is_refused(module, name, heading, tmp_path, capsys):
    with pytest.raises(SystemExit):
        module._parse(["--config", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err


def test_each_configs_section_keeps_the_others(tmp_path) -> None:
    out = tmp_path / "benchmarks.md"
    titles = [
        section_title(system.SECTION_TITLE, "System", "benchmarks.system", config)
        for config in (CONFIG_7B, Path(CONFIG_8B))
    ]
    for title, row in zip(titles, ("7b", "8b"), strict=True):
        write_run_section(out, title, "python -m benchmarks.system", [], [f"| {row} |"], [])
    write_run_section(out, titles[0], "python -m benchmarks.system", [], ["| 7b again |"], [])
    text = out.read_text()
    assert text.count(titles[0] + "\n") == 1 and text.count(titles[1] + "\n") == 1
    assert "| 7b again |" in text and "| 8b |" in text and "| 7b |" not in text


def test_the_default_checkpoint_dirs_differ_per_config() -> None:
    dirs = {
        default_checkpoint_dir(c) for c in (CONFIG_7B, CONFIG_8B, "services/assets/tiny-qwen3-vl")
    }
    assert len(dirs) == 3


def test_the_top_levels_requests_all_get_their_pages() -> None:
    # 256 requests of 1000 + 1000 tokens and the chat template's, 16-token pages, + 64 spare
    assert system_memory.default_num_pages((1, 64, 256), 1000, 1000, 1) == 33_088
    assert system_memory.default_num_pages((256,), 1000, 1000, 2) == 16_576


@pytest.mark.parametrize(
    ("config", "gpu_gb", "fits"),
    [
        (CONFIG_7B, 85.0, True),  # an 80 GB H100: 2 x 15.2 GB + 30.4 GB of KV
        (CONFIG_8B, 85.0, False),  # 2 x 16.4 GB + 78.1 GB of KV
        (CONFIG_8B, 150.0, True),  # an H200
    ],
)
def test_a_single_gpu_that_cannot_hold_the_top_level_is_refused(
    monkeypatch, capsys, config, gpu_gb, fits
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(total_memory=int(gpu_gb * 1e9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
    args = system._parse(["--config", str(config), "--concurrency", "256"])
    reason = system_memory.fits_one_gpu(
        args, system_memory.default_num_pages((256,), 1000, 1000, 1)
    )
    assert (reason is None) == fits
    assert "decode's KV 33088 pages" in capsys.readouterr().out
    spread = system._parse(["--config", str(config), "--decode-device", "cuda:0,cuda:1"])
    assert system_memory.fits_one_gpu(spread, 10**6) is None  # several GPUs: not checked here


H100_GB = 85.0  # an 80 GB H100's total_memory, 85.0e9 bytes


@pytest.mark.parametrize(
    ("flags", "fits", "weights_gb", "page_mb"),
    [
        ((), False, 15.2, 0.92),  # 2 x 15.2 GB + 66,112 pages x 0.92 MB = 91.1 GB
        (("--kv-cache-dtype", FP8_E4M3), True, 15.2, 0.46),  # 2 x 15.2 + 30.3 GB
        (("--quantization", FP8), True, 8.7, 0.92),  # 2 x 8.7 + 60.7 GB
        (("--quantization", FP8, "--kv-cache-dtype", FP8_E4M3), True, 8.7, 0.46),  # 47.8 GB
    ],
)
def test_the_fit_check_counts_fp8_weights_and_kv_pages(
    monkeypatch, capsys, flags, fits, weights_gb, page_mb
) -> None:
    """The 7B at c = 512, 1000/1000 on one 80 GB H100: bf16 is refused, FP8 KV or weights fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(total_memory=int(H100_GB * 1e9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
    args = system._parse(["--concurrency", "256,512", *flags])
    num_pages = system_memory.default_num_pages((256, 512), 1000, 1000, 1)
    reason = system_memory.fits_one_gpu(args, num_pages)
    assert (reason is None) == fits, reason
    out = capsys.readouterr().out
    assert f"weights {weights_gb:.1f} GB each" in out
    assert f"decode's KV 66112 pages x {page_mb:.2f} MB" in out
    assert out.startswith(f"GPU memory ({' '.join(flags) or 'the checkpoint dtype'})")


def test_the_precision_flags_take_the_engines_choices(capsys) -> None:
    assert Precision.of(system._parse([])) == Precision(NO_QUANTIZATION, AUTO_KV_CACHE_DTYPE)
    args = system._parse(["--quantization", FP8, "--kv-cache-dtype", FP8_E4M3])
    assert Precision.of(args) == Precision(FP8, FP8_E4M3)
    for flag in ("--quantization", "--kv-cache-dtype"):
        with pytest.raises(SystemExit):
            system._parse([flag, "int8"])
        assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_an_fp8_run_gets_a_section_of_its_own(tmp_path) -> None:
    """bf16, FP8 weights, FP8 KV and both: four titles naming their flags, none overwriting
    another; another config's title names both."""
    precisions = [
        Precision(),
        Precision(FP8),
        Precision(kv_cache_dtype=FP8_E4M3),
        Precision(FP8, FP8_E4M3),
    ]
    titles = [
        section_title(system.SECTION_TITLE, "System", "benchmarks.system", CONFIG_7B, p)
        for p in precisions
    ]
    assert titles[0] == system.SECTION_TITLE
    assert titles[3] == (
        "## System with FP8 weights and FP8 KV cache (`python -m benchmarks.system "
        "--quantization fp8 --kv-cache-dtype fp8_e4m3`)"
    )
    assert "with FP8 weights (" in titles[1] and "with FP8 KV cache (" in titles[2]
    assert section_title("## Default", "System", "benchmarks.system", CONFIG_8B, precisions[3]) == (
        "## System at qwen3-vl-8b dimensions with FP8 weights and FP8 KV cache (`python -m "
        f"benchmarks.system --config {CONFIG_8B} --quantization fp8 --kv-cache-dtype fp8_e4m3`)"
    )
    out = tmp_path / "benchmarks.md"
    for index, title in enumerate(titles):
        write_run_section(out, title, "python -m benchmarks.system", [], [f"| {index} |"], [])
    text = out.read_text()
    assert all(text.count(title + "\n") == 1 for title in titles)
    assert all(f"| {index} |" in text for index in range(4))
