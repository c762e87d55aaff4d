"""Qwen2.5-VL: vision tower + language model + LM head.

Parameter names follow the original Qwen2.5-VL checkpoints (``visual.*``, ``model.*``,
``lm_head.*``), so a real checkpoint's tensors load by name.

Image embeddings are merged into the token embeddings of the *whole* request, in
request-global order, before any split of the sequence across ranks. The class is also
the base of the Qwen3-VL family (``qwen3_vl.py``), whose image rows are wider: they carry
DeepStack rows, which ``embed`` keeps next to each token's embedding (see language.py).

Under tensor parallelism (``tp``) the decoder is split over the group (language.py) and the LM
head holds this rank's rows of the vocabulary, its logits all-gathered. The vision tower splits
over its own ``vision_tp`` (the vision encoder's ``--tp``, vision.py); with ``vision_tp`` 1
every rank that builds it holds and runs it whole. Under DP attention (``tp.dp_attention``)
only the MLP and MoE layers split; the LM head is whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.engine.attention.base import BaseAttentionBackend
from services.engine.config import ModelConfig
from services.engine.kv_cache import KVScales
from services.engine.model.language import LanguageModel
from services.engine.model.parallel_layers import ParallelLMHead
from services.engine.model.vision import GridList, VisionTransformer
from services.engine.parallel import SINGLE, HeadLayout, TensorParallel, check_tensor_parallel


class Qwen2_5_VLModel(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TensorParallel = SINGLE, vision_tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        text = config.text
        check_tensor_parallel(text, tp.size, tp.ep_size, tp.dp_attention)
        self.config = config
        self.tp = tp
        self.heads = HeadLayout.of(text.num_attention_heads, text.num_key_value_heads, tp.attention)
        self.visual = self.build_vision_tower(config, vision_tp)
        self.model = LanguageModel(text, config.num_deepstack, tp)
        self.lm_head = ParallelLMHead(text.hidden_size, text.vocab_size, tp.attention)
        if text.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the checkpoint's FP8 KV-cache scales (loader.read_kv_scales); None: it carries none
        self.kv_scales: KVScales | None = None

    def build_vision_tower(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> nn.Module:
        return VisionTransformer(config.vision, tp)

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up matmuls of every layer; parameter names and values are unchanged."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections()

    def encode_images(self, pixel_values: torch.Tensor, grids: GridList) -> torch.Tensor:
        """ViT forward for a batch of images; [sum of image tokens, hidden * (1 + K)] in image
        order, K being the number of DeepStack row sets (0 for Qwen2.5-VL)."""
        return self.visual(pixel_values, grids)

    def embed(
        self,
        input_ids: torch.Tensor,  # [T] int64
        image_embeds: torch.Tensor | None = None,  # [num_image_tokens, hidden * (1 + K)]
        image_rows: torch.Tensor
        | None = None,  # [num_image_tokens] int64, row of T each embedding replaces
    ) -> torch.Tensor:
        """Token embeddings with image rows written over the image placeholder rows; [T, hidden],
        or [T, hidden * (1 + K)] when the image rows carry K DeepStack rows (zero for text)."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None and image_embeds.numel():
            assert image_rows is not None and image_rows.numel() == image_embeds.shape[0]
            extra = image_embeds.shape[1] - embeds.shape[1]
            if extra:
                embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], extra)], dim=1)
            embeds = embeds.index_copy(0, image_rows, image_embeds.to(embeds.dtype))
        return embeds

    def forward(
        self,
        input_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T] int64
        attn: BaseAttentionBackend,  # planned for this step
        logits_indices: torch.Tensor | None = None,  # rows whose logits are wanted; None = all
        on_layer_kv: Callable[[int], None] | None = None,  # see LanguageModel.forward
    ) -> torch.Tensor:
        return self.logits(self.model(input_embeds, positions, attn, on_layer_kv), logits_indices)

    def logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:  # [rows, vocab] fp32 of the final hidden states [T, hidden]
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden)
