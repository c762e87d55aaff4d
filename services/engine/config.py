"""Model configuration read from a Hugging Face checkpoint directory's ``config.json``.

The architecture comes from ``architectures`` through the model registry
(``model/registry.py``). Both layouts Qwen2.5-VL checkpoints come in are accepted: the
original flat one (text fields at the top level, ``rope_scaling`` with ``mrope_section``)
and the nested one ``transformers`` 5 writes (``text_config`` / ``vision_config``), which
Qwen3-VL checkpoints use.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError
from services.engine.model.registry import SUPPORTED_ARCHITECTURES, ModelFamily, family_for

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "MoEConfig", "TextConfig", "VisionConfig"]

_QWEN2_5_VISION_DEFAULTS = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "hidden_act": "silu",
    "patch_size": 14,
    "out_hidden_size": 3584,
    "num_position_embeddings": 0,
    "deepstack_visual_indexes": (),
}
_QWEN3_VISION_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "patch_size": 16,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (8, 16, 24),
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # Qwen2.5-VL's windowed blocks; 0 for Qwen3-VL (full attention only)
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: ViT blocks feeding DeepStack

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has the MoE block (else the dense MLP)."""
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    mrope_interleaved: bool = False  # Qwen3: t/h/w frequencies interleaved, not in sections
    moe: MoEConfig | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    checkpoint_quantization: str = ""  # quantization_config's quant_method; "": weights unquantized

    @property
    def num_deepstack(self) -> int:
        """DeepStack row sets each image row carries (0 for Qwen2.5-VL)."""
        return len(self.vision.deepstack_visual_indexes)

    @property
    def embedding_row_width(self) -> int:
        """Elements of one image embedding row, the width the encoder writes, the transfer
        buffers hold and prefill merges: the merged embedding, then each DeepStack set's."""
        return self.vision.out_hidden_size * (1 + self.num_deepstack)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model directory {model_dir}")
        config = cls.from_dict(json.loads(path.read_text()))
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():  # transformers stops on these EOS ids too
            eos = json.loads(generation.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(t) for t in extra)]))
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        family = family_for(list(raw.get("architectures") or []), raw.get("model_type"))
        text_raw = {**raw, **(raw.get("text_config") or {})}
        vision_raw = raw.get("vision_config") or {}
        eos = text_raw.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=family.architecture,
            text=_text_config(text_raw, raw, family),
            vision=_vision_config(vision_raw, family),
            image_token_id=int(raw["image_token_id"]),
            video_token_id=int(raw["video_token_id"]),
            vision_start_token_id=int(raw["vision_start_token_id"]),
            vision_end_token_id=int(raw["vision_end_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            checkpoint_quantization=_quant_method(raw),
        )


def _quant_method(raw: dict[str, Any]) -> str:
    quant = raw.get("quantization_config") or raw.get("compression_config")
    if not quant:
        return ""
    if quant.get("kv_cache_scheme") and not quant.get("config_groups"):
        return ""  # compressed-tensors with the KV cache's scales only: the weights are as saved
    return str(quant.get("quant_method") or quant.get("format") or "unknown")


def _text_config(text_raw: dict[str, Any], raw: dict[str, Any], family: ModelFamily) -> TextConfig:
    rope = text_raw.get("rope_scaling") or text_raw.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ModelLoadError("config.json has no mrope_section (rope_scaling / rope_parameters)")
    hidden = int(text_raw["hidden_size"])
    heads = int(text_raw["num_attention_heads"])
    head_dim = int(text_raw.get("head_dim") or hidden // heads)
    if sum(section) * 2 != head_dim:
        raise ModelLoadError(f"mrope_section {section} does not cover head_dim {head_dim}")
    tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
    attention_bias = bool(text_raw.get("attention_bias", False))
    return TextConfig(
        vocab_size=int(text_raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(text_raw["intermediate_size"]),
        num_hidden_layers=int(text_raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text_raw.get("num_key_value_heads") or heads),
        hidden_act=str(text_raw.get("hidden_act", "silu")),
        rms_norm_eps=float(text_raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text_raw.get("rope_theta", 1000000.0))),
        mrope_section=tuple(int(s) for s in section),
        max_position_embeddings=int(text_raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        head_dim=head_dim,
        qkv_bias=attention_bias if family.is_qwen3 else True,
        o_bias=attention_bias if family.is_qwen3 else False,
        qk_norm=family.is_qwen3,
        mrope_interleaved=bool(rope.get("mrope_interleaved", family.is_qwen3)),
        moe=_moe_config(text_raw) if family.model_type.endswith("_moe") else None,
    )


def _moe_config(text_raw: dict[str, Any]) -> MoEConfig:
    missing = [
        key
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if key not in text_raw
    ]
    if missing:
        raise ModelLoadError(f"MoE config.json has no {', '.join(missing)}")
    moe = MoEConfig(
        num_experts=int(text_raw["num_experts"]),
        num_experts_per_tok=int(text_raw["num_experts_per_tok"]),
        moe_intermediate_size=int(text_raw["moe_intermediate_size"]),
        norm_topk_prob=bool(text_raw.get("norm_topk_prob", True)),
        decoder_sparse_step=int(text_raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in text_raw.get("mlp_only_layers") or ()),
    )
    if not 0 < moe.num_experts_per_tok <= moe.num_experts or moe.decoder_sparse_step < 1:
        raise ModelLoadError(
            f"MoE config needs 0 < num_experts_per_tok <= num_experts and decoder_sparse_step "
            f">= 1, got {moe.num_experts_per_tok}, {moe.num_experts}, {moe.decoder_sparse_step}"
        )
    return moe


def _vision_config(v: dict[str, Any], family: ModelFamily) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    defaults = _QWEN3_VISION_DEFAULTS if family.is_qwen3 else _QWEN2_5_VISION_DEFAULTS
    depth = int(v.get("depth", defaults["depth"]))
    full_default = tuple(range(depth)) if family.is_qwen3 else (7, 15, 23, 31)
    deepstack = v.get("deepstack_visual_indexes", defaults["deepstack_visual_indexes"])
    return VisionConfig(
        depth=depth,
        hidden_size=int(v.get("hidden_size", defaults["hidden_size"])),
        intermediate_size=int(v.get("intermediate_size", defaults["intermediate_size"])),
        num_heads=int(v.get("num_heads", defaults["num_heads"])),
        hidden_act=str(v.get("hidden_act", defaults["hidden_act"])),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", defaults["patch_size"])),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=0 if family.is_qwen3 else int(v.get("window_size", 112)),
        out_hidden_size=int(v.get("out_hidden_size", defaults["out_hidden_size"])),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", full_default)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        num_position_embeddings=int(
            v.get("num_position_embeddings", defaults["num_position_embeddings"])
        ),
        deepstack_visual_indexes=tuple(int(i) for i in deepstack),
    )
