"""Qwen3-VL vision tower: patch embedding plus learned position embeddings interpolated to
each image's grid, LayerNorm blocks with 2D rotary and full attention per frame, the patch
merger, and DeepStack mergers over the outputs of ``deepstack_visual_indexes`` blocks.

Patches arrive in the processor's order (per image: row-major over 2x2 merge blocks) and
stay in it. Each output row (one merged patch) is the main merger's embedding followed by
one DeepStack embedding per DeepStack block: ``[num_tokens, out_hidden * (1 + K)]``.

Under tensor parallelism (``tp``) the attention and the MLP split as in ``vision.py`` (fc1
column-parallel, fc2 row-parallel); the patch and position embeddings, norms and every merger
(the DeepStack ones too) are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.config import VisionConfig
from services.engine.model.layers import activation
from services.engine.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from services.engine.model.rope import VisionRotaryEmbedding
from services.engine.model.vision import (
    GridList,
    Segments,
    VisionAttention,
    check_vision_parallel,
    hw_positions,
)
from services.engine.parallel import SINGLE, TensorParallel


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        shard = tp.split(cfg.intermediate_size, dim=0)
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, shard, bias=True)
        self.linear_fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg, tp)
        self.mlp = VisionMLP(cfg, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """2x2 patches -> one token; ``postshuffle`` (the DeepStack mergers) norms after the
    concatenation of the four patches, the main merger before it."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N / 4, out_hidden]
        if self.postshuffle:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embed_dim = cfg.hidden_size
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [N, C*T*P*P] -> [N, hidden]; a stride==kernel conv is a matmul over the flattened patch
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


def interpolation_taps(grids: GridList, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps of each patch into the ``side x side`` position table:
    indices [N, 4] int64 and weights [N, 4] fp32, patches in processor order."""
    rows_cols = hw_positions(grids, merge).to(torch.float32)  # [N, 2]
    sizes = torch.cat(
        [torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids]
    )  # [N, 2] grid (h, w) of each patch's image
    src = rows_cols * (side - 1) / torch.clamp(sizes - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # [N, 2 axes, 2]
    weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]  # [N, 2, 2]
    return indices.reshape(-1, 4), (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)


@dataclass(frozen=True)
class Qwen3VisionLayout:
    """What a forward over one list of grids needs besides the pixels (``layout``)."""

    pos_indices: torch.Tensor  # [N, 4] int64 taps into the position table
    pos_weights: torch.Tensor  # [N, 4] fp32
    full: Segments  # one segment per frame
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_vision_parallel(cfg, tp.size)
        self.cfg = cfg
        self.num_grid_per_side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = Qwen3PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(cfg, tp) for _ in range(cfg.depth)])
        self.merger = Qwen3PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes]
        )

    def forward(self, pixel_values: torch.Tensor, grids: GridList) -> torch.Tensor:
        """Rows of every merged patch, [sum(t*h*w/merge^2), out_hidden * (1 + K)]."""
        return self.forward_layout(pixel_values, self.layout(grids, pixel_values.device))

    def layout(self, grids: GridList, device: torch.device) -> Qwen3VisionLayout:
        merge = self.cfg.spatial_merge_size
        indices, weights = interpolation_taps(grids, merge, self.num_grid_per_side)
        cu_full = [0]
        for t, h, w in grids:  # full attention within each frame
            for _ in range(t):
                cu_full.append(cu_full[-1] + h * w)
        cos, sin = self.rotary(hw_positions(grids, merge).to(device))
        return Qwen3VisionLayout(
            indices.to(device), weights.to(device), Segments(cu_full, device), cos, sin
        )

    def forward_layout(self, pixel_values: torch.Tensor, layout: Qwen3VisionLayout) -> torch.Tensor:
        """``forward`` with its layout built: device work only (what a CUDA graph captures)."""
        x = self.patch_embed(pixel_values)  # [N, hidden]
        pos = (self.pos_embed(layout.pos_indices) * layout.pos_weights[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        rows = []
        indexes = self.cfg.deepstack_visual_indexes
        for i, block in enumerate(self.blocks):
            x = block(x, layout.cos, layout.sin, layout.full)
            if i in indexes:
                rows.append(self.deepstack_merger_list[indexes.index(i)](x))
        return torch.cat([self.merger(x), *rows], dim=1)
