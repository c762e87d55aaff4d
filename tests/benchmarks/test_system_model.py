"""The system benchmark's checkpoint: the tokenizer's vocabulary and ids on the big config, and
weights that load back as the ones ``build_random_model`` makes (tiny config here, on the CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.gpu_monitor import GpuSummary
from benchmarks.precision import Precision
from benchmarks.random_model import CONFIG_7B, build_random_model
from benchmarks.system_model import (
    EngineTimes,
    checkpoint_config,
    engine_times,
    tokenizer_dir_for,
    write_checkpoint,
)
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from services.engine.processing import TextProcessor
from services.engine.processing.image import ImageProcessor
from services.engine.quantization import FP8, FP8_E4M3
from tests.benchmarks.fake_monitor import RecordingMonitor
from tests.conftest import TINY_MODEL_DIR


def test_the_7b_config_keeps_its_vocabulary_and_takes_the_tokenizers_special_ids() -> None:
    config = checkpoint_config()
    tiny = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert config["hidden_size"] == 3584 and config["num_hidden_layers"] == 28
    assert config["vocab_size"] == 152_064  # Qwen2.5-VL-7B's, not the bundled tokenizer's 2,048
    for name in ("eos_token_id", "image_token_id", "vision_start_token_id"):
        assert config[name] == tiny[name], name


def test_the_checkpoints_tokenizer_has_the_configs_vocabulary_size(tmp_path) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 5000}))
    shutil.copy(TINY_MODEL_DIR / "preprocessor_config.json", config_dir)
    out = write_checkpoint(tmp_path / "ckpt", "cpu", config_dir=config_dir)
    assert TextProcessor.from_dir(out).vocab_size == 5000
    assert load_model(out, device="cpu").lm_head.weight.shape[0] == 5000


def test_the_written_checkpoint_loads_as_the_random_model(tmp_path) -> None:
    out = write_checkpoint(tmp_path / "ckpt", "cpu", seed=3, config_dir=TINY_MODEL_DIR)
    assert (
        TextProcessor.from_dir(out).vocab_size
        <= json.loads((out / "config.json").read_text())["vocab_size"]
    )
    loaded = load_model(out, device="cpu")
    built = build_random_model(out, device="cpu", seed=3)
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), built.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b.to(a.dtype)), name
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    write_checkpoint(out, "cpu", seed=3, config_dir=TINY_MODEL_DIR)  # kept: same config
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_1080p_image_takes_the_7b_models_tokens_in_the_checkpoint_config() -> None:
    processor = ImageProcessor.from_dir(CONFIG_7B)  # what write_checkpoint copies
    assert processor.num_image_tokens(processor.grid_for_size(1080, 1920)) == 39 * 69
    assert checkpoint_config()["vision_config"]["depth"] == 32


def test_the_checkpoint_has_the_configs_vision_tower_and_preprocessor(tmp_path) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    shutil.copy(TINY_MODEL_DIR / "config.json", config_dir / "config.json")
    preprocessor = json.loads((TINY_MODEL_DIR / "preprocessor_config.json").read_text())
    max_pixels = 28 * 28 * 100
    preprocessor.update(
        max_pixels=max_pixels, size={"shortest_edge": 3136, "longest_edge": max_pixels}
    )
    (config_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    out = write_checkpoint(tmp_path / "ckpt", "cpu", config_dir=config_dir)
    assert ImageProcessor.from_dir(out).config.max_pixels == max_pixels
    built = build_random_model(out, device="cpu").state_dict()
    visual = {n: list(t.shape) for n, t in built.items() if n.startswith("visual.")}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert visual and {n: f.get_slice(n).get_shape() for n in visual} == visual
    shutil.copy(TINY_MODEL_DIR / "preprocessor_config.json", out / "preprocessor_config.json")
    write_checkpoint(out, "cpu", config_dir=config_dir)  # weights kept, the preprocessor refreshed
    assert ImageProcessor.from_dir(out).config.max_pixels == max_pixels


def test_the_bound_of_each_requests_prefill_and_its_share_of_decode_steps() -> None:
    engine = EngineTimes(1000, 1500, 20.0, {256: 12.0}, {256: 15.0}, 25.0, {256: 12.8})
    # 1000 tokens per request: 20 ms of prefill + 1000 steps' 1/256 share of 12 ms
    assert engine.bound_tok_s(256, 1000) == pytest.approx(1000 / (20.0 + 1000 * 12.0 / 256) * 1e3)
    assert engine.sustained_bound_tok_s(256, 1000) == pytest.approx(
        1000 / (25.0 + 1000 * 12.8 / 256) * 1e3
    )
    assert engine.sustained_bound_tok_s(512, 1000) is None  # not measured at that batch
    short_only = EngineTimes(1000, 1500, 20.0, {256: 12.0}, {256: 15.0})
    assert short_only.sustained_bound_tok_s(256, 1000) is None


def test_engine_times_short_then_sustained_each_phase_watched() -> None:
    monitor = RecordingMonitor(GpuSummary(1, 1.0, 1650.0, 690.0, 1.0))
    engine = engine_times(TINY_MODEL_DIR, "cpu", "torch", 16, 8, (1, 2), False, 0.3, monitor)
    assert set(engine.decode_ms) == set(engine.sustained_decode_ms) == {1, 2}
    assert engine.prefill_ms > 0 and engine.sustained_prefill_ms > 0
    phases = ["decode b1", "decode b2", "prefill", "sustained decode b1", "sustained decode b2"]
    assert list(engine.gpu) == [*phases, "sustained prefill"]  # the short times first
    sustained = monitor.windows[3:]
    assert all(end - start >= 0.3 for start, end in sustained)  # each ran back to back that long
    without = engine_times(TINY_MODEL_DIR, "cpu", "torch", 16, 8, (1,), False)
    assert without.sustained_prefill_ms is None and without.sustained_decode_ms == {}
    assert without.gpu == {}


@pytest.mark.parametrize(
    ("random_weights", "precision", "held"),
    [
        (False, Precision(), "q/k/v weights float32, KV pages float32"),
        (True, Precision(FP8, FP8_E4M3), "q/k/v weights float8_e4m3fn, KV pages float8_e4m3fn"),
        (False, Precision(FP8), "q/k/v weights float8_e4m3fn, KV pages float32"),
    ],
    ids=["loaded", "random-fp8-both", "loaded-fp8-weights"],
)
def test_engine_times_hold_the_model_and_pool_in_the_precision_asked(
    random_weights, precision, held
) -> None:
    """The bound's weights (built at random as the checkpoint was, or loaded) and KV pages are
    the services' (the tiny model is float32)."""
    engine = engine_times(
        TINY_MODEL_DIR, "cpu", "torch", 16, 8, (1,), random_weights, precision=precision
    )
    assert engine.held == held
    assert engine.prefill_ms > 0 and engine.decode_ms[1] > 0


CONFIG_8B = CONFIG_7B.parent / "qwen3-vl-8b"
TINY_QWEN3 = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"


def test_a_qwen3_config_takes_the_qwen3_tokenizers_ids_where_it_keeps_them() -> None:
    assert tokenizer_dir_for(CONFIG_8B) == TINY_QWEN3
    assert tokenizer_dir_for(CONFIG_7B) == TINY_MODEL_DIR
    config = checkpoint_config(CONFIG_8B)
    tiny = json.loads((TINY_QWEN3 / "config.json").read_text())
    text = config["text_config"]
    assert text["vocab_size"] == 151_936 and text["num_hidden_layers"] == 36  # the 8B's
    for name in ("bos_token_id", "eos_token_id"):  # Qwen3-VL keeps these in text_config
        assert text[name] == tiny["text_config"][name] and name not in config, name
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        assert config[name] == tiny[name], name
    model_config = ModelConfig.from_dict(config)
    assert model_config.eos_token_ids == (2,) and model_config.vision.patch_size == 16


def _small_qwen3_config(tmp_path: Path) -> Path:
    """The Qwen3-VL-8B config shrunk to a CPU's size: 2 layers, DeepStack after ViT block 0, a
    5,000-id vocabulary; its preprocessor file (16-pixel patches) as it is."""
    config = json.loads((CONFIG_8B / "config.json").read_text())
    config["text_config"].update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=5000,
        rope_scaling={
            "mrope_interleaved": True,
            "mrope_section": [6, 5, 5],
            "rope_type": "default",
        },
    )
    config["vision_config"].update(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    config_dir = tmp_path / "qwen3-vl-small"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(config))
    shutil.copy(CONFIG_8B / "preprocessor_config.json", config_dir)
    return config_dir


def test_a_qwen3_checkpoint_loads_through_the_loader_with_its_processor(tmp_path) -> None:
    out = write_checkpoint(
        tmp_path / "ckpt", "cpu", seed=5, config_dir=_small_qwen3_config(tmp_path)
    )
    text = TextProcessor.from_dir(out)
    assert text.vocab_size == 5000  # the Qwen3 tiny tokenizer grown to the config's
    for name in ("tokenizer_config.json", "generation_config.json"):  # its chat template too
        assert (out / name).read_text() == (TINY_QWEN3 / name).read_text()
    processor = ImageProcessor.from_dir(out)
    assert processor.config.patch_size == 16
    assert processor.grid_for_size(1080, 1920) == (1, 68, 120)
    loaded = load_model(out, device="cpu")
    assert type(loaded).__name__ == "Qwen3VLModel" and loaded.config.num_deepstack == 1
    assert loaded.lm_head.weight.shape[0] == 5000
    built = build_random_model(out, device="cpu", seed=5)
    for (name, a), (_, b) in zip(
        loaded.state_dict().items(), built.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b.to(a.dtype)), name
