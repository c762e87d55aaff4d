"""Checkpoint loading: both name layouts, sharded files, tied embeddings, and precise errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import ModelLoadError
from services.engine.config import ModelConfig
from services.engine.loader import load_model
from tests.conftest import TINY_MODEL_DIR


def copy_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    return load_file(str(src / "model.safetensors"))


def write_config(dst: Path, **changes) -> None:
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))


def test_loads_bundled_checkpoint(tiny_model_dir):
    model = load_model(tiny_model_dir)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert torch.equal(
        model.model.layers[1].mlp.up_proj.weight, weights["model.layers.1.mlp.up_proj.weight"]
    )
    assert torch.equal(model.visual.merger.mlp[2].bias, weights["visual.merger.mlp.2.bias"])
    assert model.lm_head.weight.dtype == torch.float32


def test_sharded_nested_names_and_bf16(tiny_model_dir, tmp_path):
    dst = tmp_path / "sharded"
    weights = copy_checkpoint(tiny_model_dir, dst)
    renamed = {
        k.replace("model.", "model.language_model.", 1)
        if k.startswith("model.")
        else k.replace("visual.", "model.visual.", 1)
        if k.startswith("visual.")
        else k: v
        for k, v in weights.items()
    }
    names = sorted(renamed)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, str(dst / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(dst, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(
        model.model.embed_tokens.weight, weights["model.embed_tokens.weight"].bfloat16()
    )


def test_tied_embeddings_without_lm_head(tiny_model_dir, tmp_path):
    dst = tmp_path / "tied"
    weights = copy_checkpoint(tiny_model_dir, dst)
    del weights["lm_head.weight"]
    save_file(weights, str(dst / "model.safetensors"))
    write_config(dst, tie_word_embeddings=True)
    model = load_model(dst)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda w: w.pop("model.layers.2.self_attn.k_proj.bias"),
            "missing tensors: model.layers.2.self_attn.k_proj.bias",
        ),
        (
            lambda w: w.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(1)),
            "unexpected tensors: model.layers.9.mlp.up_proj.weight",
        ),
        (
            lambda w: w.__setitem__("visual.merger.mlp.0.bias", torch.zeros(3)),
            "tensor 'visual.merger.mlp.0.bias' has shape (3,)",
        ),
    ],
)
def test_bad_tensors_are_named(tiny_model_dir, tmp_path, mutate, message):
    dst = tmp_path / "bad"
    weights = copy_checkpoint(tiny_model_dir, dst)
    mutate(weights)
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(dst)


def test_unknown_architecture_names_supported(tiny_model_dir, tmp_path):
    dst = tmp_path / "llama"
    copy_checkpoint(tiny_model_dir, dst)
    write_config(dst, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(
        ModelLoadError,
        match="unsupported architecture.*supported: Qwen2_5_VLForConditionalGeneration",
    ):
        ModelConfig.from_dir(dst)


def test_eos_ids_are_config_and_generation_config_ids(tiny_model_dir, tmp_path):
    """The one read of the EOS ids every service stops on (as ``transformers`` stops)."""
    assert ModelConfig.from_dir(tiny_model_dir).eos_token_ids == (2, 0)
    assert load_model(tiny_model_dir, components=("language",)).config.eos_token_ids == (2, 0)
    dst = tmp_path / "no_generation_config"
    dst.mkdir()
    shutil.copy(tiny_model_dir / "config.json", dst / "config.json")
    assert ModelConfig.from_dir(dst).eos_token_ids == (2,)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_dir(dst).eos_token_ids == (2, 7)


def test_missing_files_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((TINY_MODEL_DIR / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no .safetensors files"):
        load_model(tmp_path)


def test_load_one_component(tiny_model_dir):
    vision = load_model(tiny_model_dir, components=("vision",))
    assert vision.model is None and vision.lm_head is None
    assert sum(p.numel() for p in vision.parameters()) == sum(
        p.numel() for p in load_model(tiny_model_dir).visual.parameters()
    )
    language = load_model(tiny_model_dir, components=("language",))
    assert language.visual is None and language.lm_head is not None
    with pytest.raises(ValueError, match="components must be"):
        load_model(tiny_model_dir, components=("audio",))


QWEN3_MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
LAYER0 = "model.language_model.layers.0."


def _qwen3_moe_error(tmp_path: Path, mutate, **text_changes) -> str:
    dst = tmp_path / "qwen3_moe"
    weights = copy_checkpoint(QWEN3_MOE_DIR, dst)
    mutate(weights)
    save_file(weights, str(dst / "model.safetensors"))
    if text_changes:
        config = json.loads((dst / "config.json").read_text())
        config["text_config"].update(text_changes)
        (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(dst)
    return str(err.value)


def test_qwen3_moe_missing_tensor_is_named(tmp_path):
    name = LAYER0 + "self_attn.q_norm.weight"
    message = _qwen3_moe_error(tmp_path, lambda w: w.pop(name))
    assert "missing tensors: model.layers.0.self_attn.q_norm.weight" in message


def test_qwen3_moe_wrong_shape_is_named(tmp_path):
    name = "model.visual.deepstack_merger_list.1.linear_fc1.weight"
    message = _qwen3_moe_error(tmp_path, lambda w: w.__setitem__(name, torch.zeros(128, 64)))
    assert (
        "tensor 'visual.deepstack_merger_list.1.linear_fc1.weight' has shape (128, 64)" in message
    )


def test_qwen3_moe_expert_count_mismatch_is_named(tmp_path):
    message = _qwen3_moe_error(tmp_path, lambda w: None, num_experts=6)
    assert "tensor 'model.layers.0.mlp.gate.weight' has shape (8, 64)" in message
    assert "config implies (6, 64)" in message


def test_qwen3_moe_loads_the_transformers_saved_expert_layout(tmp_path):
    dst = tmp_path / "saved_layout"
    weights = copy_checkpoint(QWEN3_MOE_DIR, dst)
    for key in [k for k in weights if ".mlp.experts." in k]:
        weights[key] = weights[key].transpose(1, 2).contiguous()  # [E, 2I, H], [E, H, I]
    save_file(weights, str(dst / "model.safetensors"))
    ours = load_model(dst).model.layers[0].mlp.experts
    released = load_file(str(QWEN3_MOE_DIR / "model.safetensors"))
    assert ours.gate_up_proj.shape == (8, 96, 64)
    assert torch.equal(ours.gate_up_proj, released[LAYER0 + "mlp.experts.gate_up_proj"].mT)
    assert torch.equal(ours.down_proj, released[LAYER0 + "mlp.experts.down_proj"].mT)
