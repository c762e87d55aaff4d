"""The model registry and the Qwen3-VL fields of the model config."""

from __future__ import annotations

import json

import pytest

from services.common.errors import ModelLoadError
from services.common.paths import BUNDLED_MODEL
from services.engine.config import ModelConfig
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.qwen3_vl import Qwen3VLModel
from services.engine.model.registry import SUPPORTED_ARCHITECTURES, family_for, model_class

ASSETS = BUNDLED_MODEL.parent


def raw_config(name: str) -> dict:
    return json.loads((ASSETS / name / "config.json").read_text())


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("tiny-qwen2.5-vl", Qwen2_5_VLModel),
        ("tiny-qwen3-vl", Qwen3VLModel),
        ("tiny-qwen3-vl-moe", Qwen3VLModel),
    ],
)
def test_architecture_picks_the_model_class(name, cls):
    raw = raw_config(name)
    config = ModelConfig.from_dict(raw)
    assert config.architecture == raw["architectures"][0]
    assert model_class(config.architecture) is cls
    without = {k: v for k, v in raw.items() if k != "architectures"}
    assert ModelConfig.from_dict(without).architecture == config.architecture  # by model_type


def test_unknown_architecture_names_it_and_the_supported_list():
    raw = {**raw_config("tiny-qwen3-vl"), "architectures": ["MysteryForCausalLM"]}
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert "MysteryForCausalLM" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert len(SUPPORTED_ARCHITECTURES) == 3
    with pytest.raises(ModelLoadError, match="'llama'"):
        family_for([], "llama")


def test_qwen3_fields_are_read_from_config_json():
    qwen2_5 = ModelConfig.from_dict(raw_config("tiny-qwen2.5-vl"))
    assert (qwen2_5.text.qkv_bias, qwen2_5.text.o_bias, qwen2_5.text.qk_norm) == (
        True,
        False,
        False,
    )
    assert not qwen2_5.text.mrope_interleaved and qwen2_5.text.moe is None
    assert qwen2_5.vision.deepstack_visual_indexes == () and qwen2_5.text.head_dim == 16
    qwen3 = ModelConfig.from_dict(raw_config("tiny-qwen3-vl"))
    text, vision = qwen3.text, qwen3.vision
    assert text.head_dim == 32 != text.hidden_size // text.num_attention_heads
    assert (text.qkv_bias, text.o_bias, text.qk_norm, text.mrope_interleaved) == (
        False,
        False,
        True,
        True,
    )
    assert text.rope_theta == 5000000.0 and text.mrope_section == (6, 5, 5)
    assert vision.patch_size == 16 and vision.num_position_embeddings == 64
    assert vision.deepstack_visual_indexes == (0, 2) and vision.hidden_act == "gelu_pytorch_tanh"
    moe = ModelConfig.from_dict(raw_config("tiny-qwen3-vl-moe")).text.moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok) == (8, 2)
    assert [moe.is_sparse(i) for i in range(4)] == [True, True, False, True]


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_moe_layers():
    raw = raw_config("tiny-qwen3-vl-moe")
    raw["text_config"].update(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)
    moe = ModelConfig.from_dict(raw).text.moe
    assert moe is not None and not moe.norm_topk_prob
    assert [moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    del raw["text_config"]["num_experts"]
    with pytest.raises(ModelLoadError, match="no num_experts"):
        ModelConfig.from_dict(raw)
