"""transformers' Qwen2.5-VL on the same config and weights: the side-by-side peer.

Decode is one ``forward`` with ``past_key_values`` (a DynamicCache filled by a prefill
of the context) per step; prefill is one ``forward`` keeping the last logits; the ViT is
``model.visual``. bf16, SDPA attention, no CUDA graphs (transformers' eager defaults).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.measure import time_ms

HF_DECODE_BATCHES = (1, 8, 32)
HF_DECODE_CONTEXTS = (1024,)
HF_PREFILL_LENS = (1024, 8192)


@torch.inference_mode()
def hf_decode_ms(peer: Any, batch_size: int, context_len: int) -> float:
    vocab = peer.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, context_len), device="cuda")
    out = peer(input_ids=ids, use_cache=True, logits_to_keep=1)
    state = {"cache": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}
    del out

    def step() -> None:
        o = peer(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
        state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)

    return time_ms(step, warmup=2, iters=10)


@torch.inference_mode()
def hf_prefill_ms(peer: Any, num_tokens: int) -> float:
    vocab = peer.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (1, num_tokens), device="cuda")
    return time_ms(
        lambda: peer(input_ids=ids, use_cache=False, logits_to_keep=1), warmup=1, iters=3
    )


@torch.inference_mode()
def hf_vit_ms(peer: Any, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> float:
    grid_thw = torch.tensor(grids, device=pixels.device)
    return time_ms(lambda: peer.model.visual(pixels, grid_thw=grid_thw), warmup=1, iters=3)
