"""The system benchmark's checkpoint: the tokenizer's vocabulary and ids on the big config, and
weights that load back as the ones ``build_random_model`` makes (tiny config here, on the CPU)."""

from __future__ import annotations

import json

import torch

from benchmarks.random_model import build_random_model
from benchmarks.system_model import checkpoint_config, write_checkpoint
from services.engine.loader import load_model
from services.engine.processing import TextProcessor
from tests.conftest import TINY_MODEL_DIR


def test_the_7b_config_takes_the_tokenizers_vocabulary_and_special_ids() -> None:
    config = checkpoint_config()
    tiny = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert config["hidden_size"] == 3584 and config["num_hidden_layers"] == 28
    for name in ("vocab_size", "eos_token_id", "image_token_id", "vision_start_token_id"):
        assert config[name] == tiny[name], name


def test_the_written_checkpoint_loads_as_the_random_model(tmp_path) -> None:
    out = write_checkpoint(tmp_path / "ckpt", "cpu", seed=3, config_dir=TINY_MODEL_DIR)
    assert TextProcessor.from_dir(out).vocab_size <= json.loads((out / "config.json").read_text())["vocab_size"]
    loaded = load_model(out, device="cpu")
    built = build_random_model(out, device="cpu", seed=3)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), built.state_dict().items(), strict=True):
        assert torch.equal(a, b.to(a.dtype)), name
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    write_checkpoint(out, "cpu", seed=3, config_dir=TINY_MODEL_DIR)  # kept: same config
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
