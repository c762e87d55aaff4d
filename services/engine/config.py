"""Model configuration read from a Hugging Face checkpoint directory's ``config.json``.

Both layouts Qwen2.5-VL checkpoints come in are accepted: the original flat one (text
fields at the top level, ``rope_scaling`` with ``mrope_section``) and the nested one
``transformers`` 5 writes (``text_config`` / ``vision_config``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
SUPPORTED_MODEL_TYPES = ("qwen2_5_vl",)


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
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


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
        architecture = _architecture(raw)
        text_raw = {**raw, **(raw.get("text_config") or {})}
        vision_raw = raw.get("vision_config") or {}
        eos = text_raw.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            text=_text_config(text_raw, raw),
            vision=_vision_config(vision_raw),
            image_token_id=int(raw["image_token_id"]),
            video_token_id=int(raw["video_token_id"]),
            vision_start_token_id=int(raw["vision_start_token_id"]),
            vision_end_token_id=int(raw["vision_end_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if not architectures and model_type in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_ARCHITECTURES[0]
    raise ModelLoadError(
        f"unsupported architecture {architectures or model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _text_config(text_raw: dict[str, Any], raw: dict[str, Any]) -> TextConfig:
    rope = text_raw.get("rope_scaling") or text_raw.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ModelLoadError("config.json has no mrope_section (rope_scaling / rope_parameters)")
    hidden = int(text_raw["hidden_size"])
    heads = int(text_raw["num_attention_heads"])
    head_dim = hidden // heads
    if sum(section) * 2 != head_dim:
        raise ModelLoadError(f"mrope_section {section} does not cover head_dim {head_dim}")
    tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
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
    )


def _vision_config(v: dict[str, Any]) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(v.get("depth", 32)),
        hidden_size=int(v.get("hidden_size", 1280)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        num_heads=int(v.get("num_heads", 16)),
        hidden_act=str(v.get("hidden_act", "silu")),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        fullatt_block_indexes=tuple(
            int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))
        ),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
    )
