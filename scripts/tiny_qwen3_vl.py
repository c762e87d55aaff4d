"""Configs and tensor shapes of the tiny Qwen3-VL and Qwen3-VL-MoE checkpoints.

Used by ``make_tiny_checkpoint.py --arch qwen3_vl|qwen3_vl_moe``. Names and layouts are the
ones transformers 5 writes: nested ``model.language_model.*`` / ``model.visual.*``, and
the MoE experts of a layer stacked as ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * I]``
and ``mlp.experts.down_proj`` ``[E, I, hidden]`` (the released Qwen3-VL-MoE layout).
"""

from __future__ import annotations

import copy

import tiny_layers

VISION = {
    **tiny_layers.VISION,
    "model_type": "qwen3_vl_vision",
    "hidden_act": "gelu_pytorch_tanh",
    "patch_size": 16,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 2],
    "initializer_range": 0.02,
}
TEXT = {
    **tiny_layers.TEXT,
    "model_type": "qwen3_vl_text",
    "head_dim": 32,
    "rope_theta": 5000000.0,
    "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True},
    "attention_bias": False,
}
MOE_TEXT = {
    **TEXT,
    "model_type": "qwen3_vl_moe_text",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
}


def config(moe: bool) -> dict:
    return {
        "architectures": [
            "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
        ],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        **tiny_layers.VISION_TOKEN_IDS,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": copy.deepcopy(MOE_TEXT if moe else TEXT),
        "vision_config": copy.deepcopy(VISION),
    }


def _is_sparse(t: dict, layer: int) -> bool:
    if "num_experts" not in t or layer in t["mlp_only_layers"]:
        return False
    return (layer + 1) % t["decoder_sparse_step"] == 0


def _text_shapes(t: dict) -> dict[str, tuple[int, ...]]:
    h, d = t["hidden_size"], t["head_dim"]
    m = "model.language_model."
    shapes = tiny_layers.text_ends(m, t)
    for n in range(t["num_hidden_layers"]):
        p = f"{m}layers.{n}."
        shapes |= tiny_layers.decoder_layer(p, t, d, qkv_bias=False)
        shapes |= {
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        }
        if _is_sparse(t, n):
            e, mi = t["num_experts"], t["moe_intermediate_size"]
            shapes |= {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.experts.gate_up_proj": (e, h, 2 * mi),
                p + "mlp.experts.down_proj": (e, mi, h),
            }
        else:
            shapes |= tiny_layers.gated_mlp(p + "mlp.", h, t["intermediate_size"], bias=False)
    return shapes


def _merger_shapes(prefix: str, v: dict, postshuffle: bool) -> dict[str, tuple[int, ...]]:
    merged = v["hidden_size"] * v["spatial_merge_size"] ** 2
    norm = merged if postshuffle else v["hidden_size"]
    return {
        prefix + "norm.weight": (norm,),
        prefix + "norm.bias": (norm,),
        prefix + "linear_fc1.weight": (merged, merged),
        prefix + "linear_fc1.bias": (merged,),
        prefix + "linear_fc2.weight": (v["out_hidden_size"], merged),
        prefix + "linear_fc2.bias": (v["out_hidden_size"],),
    }


def _vision_shapes(v: dict) -> dict[str, tuple[int, ...]]:
    vh, vi = v["hidden_size"], v["intermediate_size"]
    m = "model.visual."
    shapes = {
        m + "patch_embed.proj.weight": tiny_layers.patch_embed(v),
        m + "patch_embed.proj.bias": (vh,),
        m + "pos_embed.weight": (v["num_position_embeddings"], vh),
    }
    for n in range(v["depth"]):
        p = f"{m}blocks.{n}."
        shapes |= tiny_layers.vision_block(p, v)
        shapes |= {
            p + "norm1.bias": (vh,),
            p + "norm2.bias": (vh,),
            p + "mlp.linear_fc1.weight": (vi, vh),
            p + "mlp.linear_fc1.bias": (vi,),
            p + "mlp.linear_fc2.weight": (vh, vi),
            p + "mlp.linear_fc2.bias": (vh,),
        }
    shapes |= _merger_shapes(m + "merger.", v, postshuffle=False)
    for k in range(len(v["deepstack_visual_indexes"])):
        shapes |= _merger_shapes(f"{m}deepstack_merger_list.{k}.", v, postshuffle=True)
    return shapes


def parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint of ``cfg`` (``config(moe)``) with its shape."""
    return _text_shapes(cfg["text_config"]) | _vision_shapes(cfg["vision_config"])


def preprocessor_config(base: dict) -> dict:
    """The Qwen2.5-VL tiny processor config at patch 16: 4..64 merged tokens of 32x32 pixels."""
    min_pixels, max_pixels = 64 * 64, 32 * 32 * 64
    return {
        **base,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_pixels": max_pixels,
        "min_pixels": min_pixels,
        "patch_size": 16,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
    }
