"""Fixtures of the engine's GPU tests."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def small_config_dir(tmp_path_factory):
    """The tiny model's config with head dim 128 (flashinfer has no kernels for its 16), bf16."""
    raw = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    raw.update(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=512,
        num_hidden_layers=3,
        torch_dtype="bfloat16",
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )
    path = tmp_path_factory.mktemp("small128")
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture
def fp8_gpu():
    """Skips the test unless a GPU with FP8 tensor cores (SM 8.9+) is here."""
    import torch

    from services.engine import fp8

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("needs FP8 tensor cores (SM 8.9+)")
