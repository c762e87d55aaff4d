"""Load a Hugging Face checkpoint directory into the engine's model.

The model is built on the meta device and every parameter is assigned from the
checkpoint straight onto the target device in the target dtype, so no random init
runs and no second copy of the weights is made. Any missing, unexpected or
mis-shaped tensor is a ``ModelLoadError`` naming it.

Under tensor parallelism each rank reads only its slice of each split tensor (the layers name
them in ``tp_shards``, see model/parallel_layers.py) through safetensors' ``get_slice``: a
rank's memory holds about ``1 / tp.size`` of the split tensors, never a whole one. A layer
whose parameter stacks several slices of one checkpoint tensor (the ViT's fused q/k/v: this
rank's heads of each third) names a tuple of them, read and concatenated in order.

A checkpoint's FP8 KV-cache scales (vLLM / compressed-tensors names, ``read_kv_scales``) are
not parameters: they are read apart, whole on every rank, into ``model.kv_scales``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.engine import fp8
from services.engine.config import ModelConfig
from services.engine.kv_cache import KVScales
from services.engine.model.moe import EXPERT_TENSORS, checkpoint_expert
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.registry import model_class
from services.engine.parallel import SINGLE, Shard, TensorParallel
from services.engine.quantization import FP8, NO_QUANTIZATION, check_quantization

# transformers >= 5 saves the nested layout; the engine uses the original one.
_PREFIX_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))
COMPONENTS = ("vision", "language")
_COMPONENT_PREFIXES = {"vision": ("visual.",), "language": ("model.", "lm_head.")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TpSlice = Shard | tuple[Shard, ...]  # one slice, or slices of one dim stacked in order
# a layer's KV-cache scale: k_scale, v_scale, or one kv_scale for both (older vLLM checkpoints)
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)")


def canonical_name(name: str) -> str:
    for old, new in _PREFIX_ALIASES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"checkpoint index names missing files: {', '.join(missing)}")
    return files


def tp_shards(model: torch.nn.Module) -> dict[str, TpSlice]:
    """The split parameters of ``model`` by checkpoint name, with this rank's slice of each;
    whole-tensor slices (a group of 1) are left out."""
    shards = {}
    for prefix, module in model.named_modules():
        for name, shard in getattr(module, "tp_shards", {}).items():
            if getattr(module, name) is not None and not _is_whole(shard):
                shards[f"{prefix}.{name}" if prefix else name] = shard
    return shards


def _is_whole(shard: TpSlice) -> bool:
    parts = shard if isinstance(shard, tuple) else (shard,)
    return sum(p.size for p in parts) == parts[0].total


def read_shard(f, key: str, shard: TpSlice) -> torch.Tensor:  # f: an open safetensors file
    if isinstance(shard, tuple):
        return torch.cat([read_shard(f, key, part) for part in shard], dim=shard[0].dim)
    tensor = f.get_slice(key)
    shape = tensor.get_shape()
    if len(shape) <= shard.dim or shape[shard.dim] != shard.total:
        raise ModelLoadError(
            f"tensor {key!r} has shape {tuple(shape)}; splitting dim {shard.dim} over the "
            f"tensor-parallel group needs {shard.total} there"
        )
    return tensor[shard.index(len(shape))].contiguous()


def read_state_dict(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    prefixes: tuple[str, ...] = ("",),
    shards: dict[str, TpSlice] | None = None,  # tensors read as this rank's slice (tp_shards)
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    shards = shards or {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                name = canonical_name(key)
                if not name.startswith(prefixes) or _KV_SCALE.fullmatch(name):
                    continue
                if name in tensors:
                    raise ModelLoadError(f"tensor {key!r} appears twice in the checkpoint")
                shard = shards.get(name)
                tensor = f.get_tensor(key) if shard is None else read_shard(f, key, shard)
                tensor = tensor.to(device)
                tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


def read_kv_scales(model_dir: Path, num_layers: int) -> KVScales | None:
    """The checkpoint's FP8 KV-cache scales (``model.layers.N.self_attn.k_scale`` and
    ``v_scale``, or one ``kv_scale`` for both); None when it carries none. ``ModelLoadError``
    for a layer without both, or a scale that is not one positive finite number."""
    found: dict[tuple[int, str], float] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = _KV_SCALE.fullmatch(canonical_name(key))
                if match is None:
                    continue
                tensor = f.get_tensor(key).float()
                value = tensor.item() if tensor.numel() == 1 else math.nan
                if not (math.isfinite(value) and value > 0):
                    raise ModelLoadError(
                        f"KV-cache scale {key!r} must be one positive finite number (a scale per "
                        f"layer), got shape {tuple(tensor.shape)}: {tensor.flatten()[:4].tolist()}"
                    )
                layer, kind = int(match[1]), match[2]
                for part in ("k", "v") if kind == "kv_scale" else (kind[0],):
                    found[(layer, part)] = value
    if not found:
        return None
    wanted = [(layer, part) for layer in range(num_layers) for part in ("k", "v")]
    if set(found) != set(wanted):
        missing = [f"{layer}.{part}_scale" for layer, part in wanted if (layer, part) not in found]
        extra = [f"{layer}.{part}_scale" for layer, part in sorted(set(found) - set(wanted))]
        raise ModelLoadError(
            f"the checkpoint's KV-cache scales do not cover its {num_layers} layers: missing "
            f"{missing[:6] or 'none'}, beyond them {extra[:6] or 'none'}"
        )
    return KVScales(
        tuple(found[(layer, "k")] for layer in range(num_layers)),
        tuple(found[(layer, "v")] for layer in range(num_layers)),
    )


def check_tensors(model: Qwen2_5_VLModel, tensors: dict[str, torch.Tensor]) -> None:
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    tied = model.config.text.tie_word_embeddings and model.lm_head is not None
    if tied:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    for name in tensors.keys() & expected.keys():
        if name.endswith(EXPERT_TENSORS) and tensors[name].dim() == 3:
            tensors[name] = checkpoint_expert(tensors[name], tuple(expected[name]))
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing tensors: {', '.join(missing[:10])}"
            + (" ..." if len(missing) > 10 else "")
        )
    if extra:
        raise ModelLoadError(
            f"checkpoint has unexpected tensors: {', '.join(extra[:10])}"
            + (" ..." if len(extra) > 10 else "")
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, the config implies {tuple(shape)}"
            )


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    components: Collection[str] = COMPONENTS,
    tp: TensorParallel = SINGLE,
    quantization: str = NO_QUANTIZATION,
    vision_tp: TensorParallel = SINGLE,
) -> Qwen2_5_VLModel:
    """Build the model for ``model_dir``'s config and load its weights onto ``device``.

    ``components`` picks the parts to build and load: ``vision`` (the ViT, for the
    vision encoder) and/or ``language`` (decoder and LM head, for prefill and decode);
    the checkpoint's tensors of the other part are not read. ``tp``: this rank's place in
    its tensor-parallel group; it reads and holds its shards of the decoder only (a
    ``ModelLoadError`` names the numbers when the model cannot split over ``tp.size``).
    ``vision_tp``: the same for the vision tower (the vision encoder's ``--tp``), whole by
    default.
    ``quantization`` (``quantization.py``): ``fp8`` quantizes the decoder's dense linears at
    load, per rank after sharding (``ValueError`` for a device that cannot run them); a
    checkpoint that is already quantized is refused (one whose only quantization is its KV
    cache's scales is not: they become ``model.kv_scales``, used by ``--kv-cache-dtype fp8_e4m3``).
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown or not components:
        raise ValueError(
            f"components must be a non-empty subset of {COMPONENTS}, got {sorted(components)}"
        )
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype or config.torch_dtype)
    check_quantization(quantization)
    if config.checkpoint_quantization:
        raise ModelLoadError(
            f"{model_dir} holds a quantized checkpoint (quantization_config: "
            f"{config.checkpoint_quantization}); stageserve loads bf16/fp16/fp32 weights and "
            "quantizes them at load (--quantization fp8): give it the unquantized checkpoint"
        )
    if quantization == FP8:
        fp8.check_fp8_device(device, dtype)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, tp, vision_tp)
    if "vision" not in components:
        model.visual = None
    if "language" not in components:
        model.model = model.lm_head = None
    prefixes = tuple(p for c in components for p in _COMPONENT_PREFIXES[c])
    tensors = read_state_dict(model_dir, device, dtype, prefixes, tp_shards(model))
    check_tensors(model, tensors)
    model.load_state_dict(tensors, strict=False, assign=True)
    if "language" in components:
        model.kv_scales = read_kv_scales(model_dir, config.text.num_hidden_layers)
    del tensors  # so the checkpoint tensors go as the fused (and FP8) ones replace them
    return finish_model(model, device, quantization)


def finish_model(
    model: Qwen2_5_VLModel, device: torch.device, quantization: str = NO_QUANTIZATION
) -> Qwen2_5_VLModel:
    """After every parameter is assigned on ``device``: tie, compute rotary buffers, fuse matmuls
    (and quantize the decoder's, with ``quantization`` fp8)."""
    if model.config.text.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if hasattr(module, "compute_inv_freq"):
            module.register_buffer("inv_freq", module.compute_inv_freq(device), persistent=False)
    model.fuse_projections()
    if quantization == FP8 and model.model is not None:
        model.model.quantize_fp8()
    return model.eval()
