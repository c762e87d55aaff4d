"""The system benchmark's memory count in FP8: ``--quantization fp8`` holds the decoder's dense
linears in one byte a parameter and an fp32 scale a row (the rest as before), ``--kv-cache-dtype
fp8_e4m3`` a KV page in one byte an element, and the count (made on the meta device) is what
the loader's model holds."""

from __future__ import annotations

import pytest

from benchmarks.precision import Precision
from benchmarks.random_model import CONFIG_7B
from benchmarks.system_memory import held_bytes, language_weight_bytes, single_gpu_bytes
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from services.engine.model.layers import PAD_INTERMEDIATE
from services.engine.quantization import FP8, FP8_E4M3, NO_QUANTIZATION
from tests.conftest import TINY_MODEL_DIR

CONFIG_8B = CONFIG_7B.parent / "qwen3-vl-8b"
TINY_DIRS = [TINY_MODEL_DIR, TINY_MODEL_DIR.parent / "tiny-qwen3-vl"]


@pytest.mark.parametrize("config_dir", [CONFIG_7B, CONFIG_8B], ids=["7b", "8b"])
def test_fp8_weights_save_a_byte_a_quantized_parameter_less_its_scales(config_dir) -> None:
    text = ModelConfig.from_dir(config_dir).text
    h, d = text.hidden_size, text.head_dim
    qkv_rows = (text.num_attention_heads + 2 * text.num_key_value_heads) * d
    inter = -(-text.intermediate_size // PAD_INTERMEDIATE) * PAD_INTERMEDIATE  # fused, padded
    params = qkv_rows * h + h * text.num_attention_heads * d + 3 * inter * h  # q/k/v, o, MLP
    rows = qkv_rows + h + 2 * inter + h  # one fp32 scale per output channel
    saved = text.num_hidden_layers * (params * (2 - 1) - rows * 4)  # bf16 -> e4m3 + scales
    bf16 = language_weight_bytes(config_dir, NO_QUANTIZATION)
    assert bf16 - language_weight_bytes(config_dir, FP8) == saved
    assert bf16 == single_gpu_bytes(config_dir)[0]


def test_the_7b_counts() -> None:
    """What the fit check prints for the 7B (issue 40's model): weights and a 16-token page."""
    assert single_gpu_bytes(CONFIG_7B) == (15_231_233_280, 2 * 28 * 16 * 4 * 128 * 2)
    fp8 = single_gpu_bytes(CONFIG_7B, Precision(FP8, FP8_E4M3))
    assert fp8 == (8_711_507_200, 2 * 28 * 16 * 4 * 128 * 1)


@pytest.mark.parametrize("quantization", [NO_QUANTIZATION, FP8])
@pytest.mark.parametrize("config_dir", TINY_DIRS, ids=lambda p: p.name)
def test_the_count_is_what_the_loaded_model_holds(config_dir, quantization) -> None:
    loaded = load_model(config_dir, "cpu", components=("language",), quantization=quantization)
    assert held_bytes(loaded) == language_weight_bytes(config_dir, quantization)


@pytest.mark.parametrize("config_dir", TINY_DIRS, ids=lambda p: p.name)
def test_fp8_kv_pages_hold_one_byte_an_element(config_dir) -> None:
    """The tiny models are float32: an FP8 page is a quarter of theirs (the 7B's half)."""
    text = ModelConfig.from_dir(config_dir).text
    elements = 2 * text.num_hidden_layers * 16 * text.num_key_value_heads * text.head_dim
    assert single_gpu_bytes(config_dir)[1] == 4 * elements
    for quantization in (NO_QUANTIZATION, FP8):
        page = single_gpu_bytes(config_dir, Precision(quantization, FP8_E4M3))[1]
        assert page == elements
