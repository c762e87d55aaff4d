"""The engine benchmark's ViT floor: the FLOPs of each family's vision tower on the 1080p grid
of its own patch size (Qwen2.5-VL's windowed tower unchanged, Qwen3-VL's full-attention one
with its DeepStack mergers), against a hand count and against the tower's own matmuls."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.engine_rows import GRID_1080P, grid_1080p
from benchmarks.measure import vit_flops
from benchmarks.random_model import CONFIG_7B
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from services.engine.processing.image import ImageProcessor
from tests.conftest import TINY_MODEL_DIR

CONFIG_8B = CONFIG_7B.parent / "qwen3-vl-8b"
TINY_QWEN3 = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
GRIDS = [(1, 4, 6), (1, 2, 2)]  # two images: attention stays within each


def test_qwen3_vit_flops_is_the_hand_count_of_the_tiny_tower() -> None:
    # tiny-qwen3-vl's tower: hidden 32, MLP 64, depth 4, 16-pixel patches, merge 2, out 64,
    # DeepStack after blocks 0 and 2 (so three mergers)
    config = ModelConfig.from_dir(TINY_QWEN3)
    n = 4 * 6 + 2 * 2  # 28 patches
    patch_embed = 2 * n * (3 * 2 * 16 * 16) * 32
    blocks = 4 * 2 * n * (32 * 96 + 32 * 32 + 2 * 32 * 64)  # qkv, proj, fc1 + fc2 (no gate)
    attention = 4 * 4 * 32 * (24**2 + 4**2)  # depth x (q.k + p.v) x hidden x pairs per image
    mergers = 3 * 2 * (n // 4) * (128 * 128 + 128 * 64)  # main + 2 DeepStack, 4 patches each
    assert patch_embed + blocks + attention + mergers == 5_922_816
    assert vit_flops(config, GRIDS) == 5_922_816


def test_qwen3_vit_flops_are_the_towers_matmuls_plus_its_attention() -> None:
    model = load_model(TINY_QWEN3, components=("vision",))
    v = model.config.vision
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(n, v.in_channels * v.temporal_patch_size * v.patch_size**2)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        rows = model.visual(pixels, GRIDS)
    assert rows.shape == (n // 4, v.out_hidden_size * 3)
    attention = v.depth * 4 * v.hidden_size * (24**2 + 4**2)  # not seen by the counter on the CPU
    assert counter.get_total_flops() + attention == vit_flops(model.config, GRIDS)


def test_qwen2_5_vit_flops_are_unchanged() -> None:
    config = ModelConfig.from_dir(CONFIG_7B)
    assert vit_flops(config, [GRID_1080P]) == 16_302_830_469_120  # the windowed tower's count
    assert vit_flops(config, [GRID_1080P] * 8) == 8 * 16_302_830_469_120


def test_the_1080p_grid_is_the_processors_for_each_patch_size() -> None:
    for config_dir, grid, tokens in (
        (CONFIG_7B, GRID_1080P, 39 * 69),
        (CONFIG_8B, (1, 68, 120), 34 * 60),
    ):
        processor = ImageProcessor.from_dir(config_dir)
        assert grid_1080p(ModelConfig.from_dir(config_dir).vision) == grid
        assert processor.grid_for_size(1080, 1920) == grid
        assert processor.num_image_tokens(grid) == tokens
    assert vit_flops(ModelConfig.from_dir(CONFIG_8B), [(1, 68, 120)]) == 15_676_424_847_360
