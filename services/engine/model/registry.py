"""The model registry: a checkpoint's ``architectures`` entry picks the model family.

Each family is one module over the shared layers (``language``, ``layers``, ``moe``,
``rope``, ``vision``, ``qwen3_vision``). This module imports no torch: the config
reader (and so the router and the tokenizer) checks the architecture with it, and the
family module is imported only when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from services.common.errors import ModelLoadError


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # config.json ``architectures`` entry
    model_type: str  # config.json ``model_type``, used when ``architectures`` is absent
    module: str  # module under services.engine.model
    class_name: str
    is_qwen3: bool  # Qwen3-VL config layout: head_dim, q/k norm, interleaved M-RoPE, DeepStack


FAMILIES = (
    ModelFamily(
        "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLModel", False
    ),
    ModelFamily("Qwen3VLForConditionalGeneration", "qwen3_vl", "qwen3_vl", "Qwen3VLModel", True),
    ModelFamily(
        "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", "qwen3_vl", "Qwen3VLModel", True
    ),
)
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)


def family_for(architectures: list[str], model_type: str | None) -> ModelFamily:
    """The family of a config's ``architectures`` (or, without any, its ``model_type``);
    ``ModelLoadError`` naming the architecture and the supported ones otherwise."""
    for name in architectures:
        for family in FAMILIES:
            if family.architecture == name:
                return family
    if not architectures:
        for family in FAMILIES:
            if family.model_type == model_type:
                return family
    raise ModelLoadError(
        f"unsupported architecture {architectures or model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family(architecture: str) -> ModelFamily:
    return family_for([architecture], None)


def model_class(architecture: str) -> Any:
    """The ``nn.Module`` class that builds a model of ``architecture`` from a ``ModelConfig``."""
    entry = family(architecture)
    module = importlib.import_module(f"services.engine.model.{entry.module}")
    return getattr(module, entry.class_name)
