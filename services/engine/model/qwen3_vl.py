"""Qwen3-VL and Qwen3-VL-MoE: the Qwen3-VL vision tower (``qwen3_vision.py``) with DeepStack,
and the Qwen3 decoder (q/k norm, interleaved M-RoPE, MoE layers where the config has
experts), over the Qwen2.5-VL model's embedding, forward and LM head.

Checkpoint names: transformers 5's nested layout (``model.language_model.*``,
``model.visual.*``, ``lm_head.*``), read as ``model.*`` / ``visual.*`` by the loader.
"""

from __future__ import annotations

from torch import nn

from services.engine.config import ModelConfig
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.qwen3_vision import Qwen3VisionTransformer
from services.engine.parallel import SINGLE, TensorParallel


class Qwen3VLModel(Qwen2_5_VLModel):
    def build_vision_tower(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> nn.Module:
        return Qwen3VisionTransformer(config.vision, tp)
