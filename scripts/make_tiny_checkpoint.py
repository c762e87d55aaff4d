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
import tiny_layers  # noqa: E402
import tiny_qwen3_vl  # noqa: E402
from tiny_tokenizer import (  # noqa: E402
    DEFAULT_OUT_DIR,
    build_tokenizer_files,
    preprocessor_config,
    write_json,
)

SEED = 20261130

VISION = {
    **tiny_layers.VISION,
    "hidden_act": "silu",
    "patch_size": 14,
    "window_size": 56,
    "fullatt_block_indexes": [1, 3],
    "tokens_per_second": 2,
}
CONFIG = {
    **tiny_layers.TEXT,
    **tiny_layers.VISION_TOKEN_IDS,
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 4,
    "pad_token_id": tiny_layers.PAD_ID,
    "torch_dtype": "float32",
    "vision_config": VISION,
}


def parameter_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in the original Qwen2.5-VL naming."""
    c, v = CONFIG, VISION
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    shapes = tiny_layers.text_ends("model.", c)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= tiny_layers.decoder_layer(p, c, head_dim, qkv_bias=True)
        shapes |= tiny_layers.gated_mlp(p + "mlp.", h, c["intermediate_size"], bias=False)
    vh, vi = v["hidden_size"], v["intermediate_size"]
    shapes["visual.patch_embed.proj.weight"] = tiny_layers.patch_embed(v)
    for n in range(v["depth"]):
        p = f"visual.blocks.{n}."
        shapes |= tiny_layers.vision_block(p, v)
        shapes |= tiny_layers.gated_mlp(p + "mlp.", vh, vi, bias=True)
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
    for token, expected in tiny_layers.SPECIAL_IDS.items():
        assert added.get(token) == expected, (
            f"tokenizer gives {token} id {added.get(token)}, expected {expected}"
        )
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", tiny_layers.GENERATION)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="qwen2_5_vl")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    build(args.out or default_out(args.arch), args.arch)


if __name__ == "__main__":
    main()
