"""Regenerate the bundled tiny checkpoints bit for bit.

    python scripts/make_tiny_checkpoint.py [--arch qwen2_5_vl|qwen3_vl|qwen3_vl_moe] [--out DIR]

Same architecture as Qwen2.5-VL (default; ``services/assets/tiny-qwen2.5-vl``), Qwen3-VL
(``tiny-qwen3-vl``) or Qwen3-VL-MoE (``tiny-qwen3-vl-moe``, see tiny_qwen3_vl.py) with small
dimensions and seeded random weights, plus the project's own small BPE tokenizer
(scripts/tiny_tokenizer.py). Each directory is a complete Hugging Face checkpoint:
transformers' AutoTokenizer, AutoImageProcessor and AutoModelForImageTextToText load it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_qwen3_vl  # noqa: E402
from tiny_tokenizer import (  # noqa: E402
    DEFAULT_OUT_DIR,
    build_tokenizer_files,
    preprocessor_config,
)

SEED = 20261130
SPECIAL_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|vision_start|>": 3,
    "<|vision_end|>": 4,
    "<|image_pad|>": 5,
    "<|video_pad|>": 6,
}

VISION = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "hidden_act": "silu",
    "in_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 56,
    "out_hidden_size": 64,
    "fullatt_block_indexes": [1, 3],
    "tokens_per_second": 2,
}
CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 4,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "image_token_id": 5,
    "video_token_id": 6,
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
    "torch_dtype": "float32",
    "vision_config": VISION,
}
GENERATION = {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}


def parameter_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in the original Qwen2.5-VL naming."""
    c, v = CONFIG, VISION
    hd = c["hidden_size"] // c["num_attention_heads"]
    q, kv, h, i = (
        c["num_attention_heads"] * hd,
        c["num_key_value_heads"] * hd,
        c["hidden_size"],
        c["intermediate_size"],
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    vh, vi, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    shapes["visual.patch_embed.proj.weight"] = (
        vh,
        v["in_channels"],
        v["temporal_patch_size"],
        patch,
        patch,
    )
    for n in range(v["depth"]):
        p = f"visual.blocks.{n}."
        shapes |= {
            p + "norm1.weight": (vh,),
            p + "norm2.weight": (vh,),
            p + "attn.qkv.weight": (3 * vh, vh),
            p + "attn.qkv.bias": (3 * vh,),
            p + "attn.proj.weight": (vh, vh),
            p + "attn.proj.bias": (vh,),
            p + "mlp.gate_proj.weight": (vi, vh),
            p + "mlp.gate_proj.bias": (vi,),
            p + "mlp.up_proj.weight": (vi, vh),
            p + "mlp.up_proj.bias": (vi,),
            p + "mlp.down_proj.weight": (vh, vi),
            p + "mlp.down_proj.bias": (vh,),
        }
    merged = vh * v["spatial_merge_size"] ** 2
    shapes |= {
        "visual.merger.ln_q.weight": (vh,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (v["out_hidden_size"], merged),
        "visual.merger.mlp.2.bias": (v["out_hidden_size"],),
    }
    return shapes


def random_weights(shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in sorted((shapes or parameter_shapes()).items()):
        if name.endswith("norm.weight") or ".norm" in name or "layernorm" in name or "ln_q" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=gen)
        else:  # stacked experts [E, in, out]: each expert's fan-in is its input dim
            fan_in = shape[1] if ".experts." in name else math.prod(shape[1:])
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        tensors[name] = t.contiguous()
    return tensors


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
ASSETS = DEFAULT_OUT_DIR.parent


def default_out(arch: str) -> Path:
    return DEFAULT_OUT_DIR if arch == "qwen2_5_vl" else ASSETS / f"tiny-{arch.replace('_', '-')}"


def build(out_dir: Path, arch: str = "qwen2_5_vl") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer_files(out_dir)
    if arch == "qwen2_5_vl":
        config, weights = CONFIG, random_weights()
    else:
        config = tiny_qwen3_vl.config(moe=arch == "qwen3_vl_moe")
        weights = random_weights(tiny_qwen3_vl.parameter_shapes(config))
        processor = tiny_qwen3_vl.preprocessor_config(preprocessor_config())
        write_json(out_dir / "preprocessor_config.json", processor)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    for token, expected in SPECIAL_IDS.items():
        assert added.get(token) == expected, (
            f"tokenizer gives {token} id {added.get(token)}, expected {expected}"
        )
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", GENERATION)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="qwen2_5_vl")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    build(args.out or default_out(args.arch), args.arch)


if __name__ == "__main__":
    main()
