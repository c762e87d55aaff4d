"""A full-size model with random weights made on the device, and transformers' peer on the same
weights.

Nothing is downloaded and nothing is initialized on the CPU: the model is built on
the meta device and every parameter is materialized with ``torch.empty(device=...)``
filled in place (normal, std 0.02, like the checkpoint's ``initializer_range``; norm
weights 1; biases small), so the numbers below are for the real model size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.engine import fp8
from services.engine.config import ModelConfig
from services.engine.loader import finish_model
from services.engine.model.layers import RMSNorm
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.registry import model_class
from services.engine.parallel import TensorParallel
from services.engine.quantization import FP8, NO_QUANTIZATION, check_quantization

CONFIG_7B = Path(__file__).resolve().parent / "configs" / "qwen2.5-vl-7b"
# ours -> transformers 5
_HF_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def _fill(name: str, module: nn.Module, t: torch.Tensor, generator: torch.Generator) -> None:
    if isinstance(module, RMSNorm):
        t.fill_(1.0)
    elif name == "bias":
        t.normal_(0.0, 0.002, generator=generator)
    else:
        t.normal_(0.0, 0.02, generator=generator)


def build_random_model(
    config_dir: str | Path = CONFIG_7B,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    tp: TensorParallel | None = None,
    quantization: str = NO_QUANTIZATION,
) -> Qwen2_5_VLModel:
    """The engine's model for ``config_dir`` with seeded random weights created on ``device``;
    ``tp``: the split it is built for (None: one rank); ``quantization``: as the loader's (fp8:
    the decoder's dense linears quantized after the weights are made, ``ValueError`` for a
    device that cannot run them)."""
    device = torch.device(device)
    check_quantization(quantization)
    if quantization == FP8:
        fp8.check_fp8_device(device, dtype)
    config = ModelConfig.from_dir(config_dir)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, *(() if tp is None else (tp,)))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":  # tied: already materialized through its owner
                continue
            data = torch.empty(param.shape, dtype=dtype, device=device)
            _fill(name, module, data, generator)
            setattr(module, name, nn.Parameter(data, requires_grad=False))
    return finish_model(model, device, quantization)


def hf_name(name: str) -> str:
    for ours, theirs in _HF_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def hf_peer(model: Qwen2_5_VLModel, config_dir: str | Path = CONFIG_7B, attn: str = "sdpa") -> Any:
    """transformers' ``Qwen2_5_VLForConditionalGeneration`` sharing ``model``'s weight tensors (no
    copy)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    weight = model.lm_head.weight
    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device(weight.device):
        peer = AutoModelForImageTextToText.from_config(
            config, dtype=weight.dtype, attn_implementation=attn
        )
    state = {hf_name(name): tensor for name, tensor in model.state_dict().items()}
    result = peer.load_state_dict(state, strict=False, assign=True)
    missing = [
        k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")
    ]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"weight names differ: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    return peer.eval()
