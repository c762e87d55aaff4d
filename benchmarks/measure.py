"""Timing, the machine's own ceilings, and the byte / FLOP counts that give each row its floor.

Floors: decode is memory-bound, so its floor is the bytes a step must read (every
decoder and LM-head weight once, plus each request's KV) over the measured copy
bandwidth; prefill and the ViT are matmul-bound, so theirs is the FLOPs of their
matmuls and attention over the measured bf16 matmul rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.config import ModelConfig
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.registry import family
from services.engine.model.vision import GridList, window_layout


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Median wall time of ``fn`` in ms between CUDA events, synchronizing after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    matmul_flops_per_s: float  # bf16 8192^3 GEMM on random data


def copy_bytes_per_s() -> float:
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").uniform_()  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def matmul_flops_per_s(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: torch.matmul(a, b, out=c), warmup=3, iters=10)
    return 2 * n**3 / (ms / 1e3)


def measure_ceilings() -> Ceilings:
    return Ceilings(copy_bytes_per_s(), matmul_flops_per_s())


def decoder_weight_bytes(model: Qwen2_5_VLModel) -> int:
    """Bytes of every weight a decode step reads in full: decoder layers, final norm, LM head."""
    total = 0
    for name, param in model.named_parameters():
        if name.startswith("visual.") or "embed_tokens" in name:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    text = config.text
    return 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * dtype_bytes


def decode_floor_bytes(model: Qwen2_5_VLModel, batch_size: int, context_len: int) -> int:
    return decoder_weight_bytes(model) + batch_size * context_len * kv_bytes_per_token(model.config)


def _linear_params_per_layer(config: ModelConfig) -> int:
    text = config.text
    h, d = text.hidden_size, text.head_dim
    qkv = h * (text.num_attention_heads + 2 * text.num_key_value_heads) * d
    return qkv + text.num_attention_heads * d * h + 3 * h * text.intermediate_size


def prefill_flops(config: ModelConfig, num_tokens: int) -> float:
    """Matmul FLOPs of one causal prefill of ``num_tokens`` (logits of the last token only)."""
    text = config.text
    linear = 2 * num_tokens * _linear_params_per_layer(config) * text.num_hidden_layers
    pairs = num_tokens * (num_tokens + 1) / 2  # causal (query, key) pairs
    attention = text.num_hidden_layers * 4 * text.num_attention_heads * text.head_dim * pairs
    return linear + attention + 2 * text.hidden_size * text.vocab_size


def vit_flops(config: ModelConfig, grids: GridList) -> float:
    """Matmul FLOPs of the config's vision tower on ``grids``: Qwen2.5-VL's windowed one or
    Qwen3-VL's (``qwen3_vit_flops``)."""
    if family(config.architecture).is_qwen3:
        return qwen3_vit_flops(config, grids)
    return qwen2_5_vit_flops(config, grids)


def qwen3_vit_flops(config: ModelConfig, grids: GridList) -> float:
    """Matmul FLOPs of Qwen3-VL's vision tower (``model/qwen3_vision.py``): the patch embedding;
    per block fused q/k/v, the output projection, a two-layer MLP and full attention within each
    frame; the patch merger and one DeepStack merger per ``deepstack_visual_indexes`` block, each
    fc1 (merged -> merged) and fc2 (merged -> out). The position table's interpolation (a gather
    and a 4-tap weighted sum), norms, rotary and biases are not matmuls."""
    v = config.vision
    merge = v.spatial_merge_size
    n = sum(t * h * w for t, h, w in grids)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    h = v.hidden_size
    per_block = 2 * n * (h * 3 * h + h * h + 2 * h * v.intermediate_size)
    frame_pairs = sum(t * (hh * ww) ** 2 for t, hh, ww in grids)  # (query, key) pairs
    attention = v.depth * 4 * h * frame_pairs  # q.k and p.v, each 2 FLOPs a pair per channel
    merged = h * merge**2
    mergers = 1 + len(v.deepstack_visual_indexes)
    merger = mergers * 2 * (n // merge**2) * (merged * merged + merged * v.out_hidden_size)
    return 2 * n * patch_dim * h + v.depth * per_block + attention + merger


def qwen2_5_vit_flops(config: ModelConfig, grids: GridList) -> float:
    """Matmul FLOPs of Qwen2.5-VL's vision tower (patch embed, blocks with window/full attention,
    gated MLP, merger)."""
    v = config.vision
    merge = v.spatial_merge_size
    n = sum(t * h * w for t, h, w in grids)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    h = v.hidden_size
    per_block = 2 * n * (h * 3 * h + h * h + 3 * h * v.intermediate_size)
    _, cu_window = window_layout(grids, merge, v.window_size // merge // v.patch_size)
    window_pairs = sum((b - a) ** 2 for a, b in zip(cu_window[:-1], cu_window[1:], strict=True))
    full_pairs = sum(t * (hh * ww) ** 2 for t, hh, ww in grids)
    num_full = len(v.fullatt_block_indexes)
    attention = 4 * h * (num_full * full_pairs + (v.depth - num_full) * window_pairs)
    merged = h * merge**2
    merger = 2 * (n // merge**2) * (merged * merged + merged * v.out_hidden_size)
    return 2 * n * patch_dim * h + v.depth * per_block + attention + merger
