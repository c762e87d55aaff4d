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

from benchmarks import image_ttft, system
from benchmarks.random_model import CONFIG_7B
from benchmarks.report import write_run_section
from benchmarks.system_model import default_checkpoint_dir, section_title

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
    assert system.default_num_pages((1, 64, 256), 1000, 1000, 1) == 33_088
    assert system.default_num_pages((256,), 1000, 1000, 2) == 16_576


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
    reason = system.fits_one_gpu(args, system.default_num_pages((256,), 1000, 1000, 1))
    assert (reason is None) == fits
    assert "decode's KV 33088 pages" in capsys.readouterr().out
    spread = system._parse(["--config", str(config), "--decode-device", "cuda:0,cuda:1"])
    assert system.fits_one_gpu(spread, 10**6) is None  # several GPUs: not checked here
