"""What the tiny Qwen2.5-VL and Qwen3-VL checkpoints share: the special-token ids, the
generation config, the text and vision dimensions, and the shapes of the layers both families
have.

Used by ``make_tiny_checkpoint.py`` (Qwen2.5-VL) and ``tiny_qwen3_vl.py``; each adds what its
family has on its own (names, activations, rope, norms with bias, mergers).
"""

from __future__ import annotations

from tiny_tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

SPECIAL_IDS = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}
BOS_ID = PAD_ID = SPECIAL_IDS["<|endoftext|>"]
EOS_ID = SPECIAL_IDS["<|im_end|>"]
VISION_TOKEN_IDS = {
    "image_token_id": SPECIAL_IDS["<|image_pad|>"],
    "video_token_id": SPECIAL_IDS["<|video_pad|>"],
    "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"],
    "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"],
}
TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
GENERATION = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, PAD_ID], "pad_token_id": PAD_ID}
VISION = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
}


def text_ends(model: str, t: dict) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and the LM head; ``model``: the decoder's name prefix."""
    return {
        model + "embed_tokens.weight": (t["vocab_size"], t["hidden_size"]),
        model + "norm.weight": (t["hidden_size"],),
        "lm_head.weight": (t["vocab_size"], t["hidden_size"]),
    }


def decoder_layer(prefix: str, t: dict, head_dim: int, qkv_bias: bool) -> dict:
    """A decoder layer's attention projections and its two norms (the MLP apart)."""
    h = t["hidden_size"]
    q, kv = t["num_attention_heads"] * head_dim, t["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "self_attn.q_proj.weight": (q, h),
        prefix + "self_attn.k_proj.weight": (kv, h),
        prefix + "self_attn.v_proj.weight": (kv, h),
        prefix + "self_attn.o_proj.weight": (h, q),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
    }
    if qkv_bias:
        shapes |= {
            prefix + "self_attn.q_proj.bias": (q,),
            prefix + "self_attn.k_proj.bias": (kv,),
            prefix + "self_attn.v_proj.bias": (kv,),
        }
    return shapes


def gated_mlp(prefix: str, hidden: int, intermediate: int, bias: bool) -> dict:
    """``gate_proj``, ``up_proj`` and ``down_proj`` under ``prefix``."""
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "gate_proj.weight": (intermediate, hidden),
        prefix + "up_proj.weight": (intermediate, hidden),
        prefix + "down_proj.weight": (hidden, intermediate),
    }
    if bias:
        shapes |= {
            prefix + "gate_proj.bias": (intermediate,),
            prefix + "up_proj.bias": (intermediate,),
            prefix + "down_proj.bias": (hidden,),
        }
    return shapes


def patch_embed(v: dict) -> tuple[int, ...]:
    """The shape of the vision patch embedding's Conv3d weight."""
    patch = v["patch_size"]
    return (v["hidden_size"], v["in_channels"], v["temporal_patch_size"], patch, patch)


def vision_block(prefix: str, v: dict) -> dict[str, tuple[int, ...]]:
    """A vision block's norm weights and attention (the MLP and norm biases apart)."""
    vh = v["hidden_size"]
    return {
        prefix + "norm1.weight": (vh,),
        prefix + "norm2.weight": (vh,),
        prefix + "attn.qkv.weight": (3 * vh, vh),
        prefix + "attn.qkv.bias": (3 * vh,),
        prefix + "attn.proj.weight": (vh, vh),
        prefix + "attn.proj.bias": (vh,),
    }
