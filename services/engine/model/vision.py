"""Qwen2.5-VL vision tower: patch embedding, window/full attention blocks with 2D
rotary, and the patch merger that maps 2x2 patches to one language-model token.

Patches arrive in the processor's order (per image: row-major over 2x2 merge blocks).
Inside the tower they are permuted so that each attention window is contiguous; the
merger output is permuted back, so rows leave in the processor's order.

Under tensor parallelism (``tp``, the vision encoder's ``--tp``) each rank holds its heads of
every attention (this rank's rows of each third of the fused q/k/v, ``FusedQKVParallelLinear``;
``proj`` row-parallel, its all-reduce ends the attention) and its share of every MLP's
intermediate features; the patch embedding, norms, rotary and the patch merger are whole on
every rank, as is the residual stream. ``check_vision_parallel`` names the sizes that do not
split. A group of 1 is the single-device tower: the same parameters, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.varlen import varlen_attn

from services.common.errors import ModelLoadError
from services.engine import ops
from services.engine.config import VisionConfig
from services.engine.model.layers import GatedMLP, RMSNorm
from services.engine.model.parallel_layers import RowParallelLinear
from services.engine.model.rope import VisionRotaryEmbedding
from services.engine.parallel import SINGLE, Shard, TensorParallel

GridList = list[tuple[int, int, int]]


class Segments:
    """Attention segments ``[cu[i], cu[i+1])`` of a sequence, grouped by length for batched attention.

    Built once per ViT forward (on the host, index tensors uploaded once) and used by every
    block with that layout: the per-layer work is then a gather, attention and a scatter per
    distinct length, or none of the gathers when the segments already tile the sequence in
    equal lengths (one image in the full-attention blocks). With ``varlen`` on a CUDA device,
    segments that do not tile the sequence run in one variable-length flash attention call
    over ``cu`` instead (bf16 / fp16 inputs). The windows take it (several lengths per image,
    where the varlen call is faster); the full-attention blocks do not (cuDNN's SDPA per
    image is faster there).
    """

    def __init__(self, cu_seqlens: list[int], device: torch.device, varlen: bool = False) -> None:
        starts_by_len: dict[int, list[int]] = {}
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            assert b >= a, f"cu_seqlens must not decrease: {cu_seqlens}"
            if b > a:
                starts_by_len.setdefault(b - a, []).append(a)
        self.num_tokens = cu_seqlens[-1]
        self.tiled_length: int | None = (
            None  # set: equal segments covering [0, N) in order, no gather
        )
        self.groups: list[
            tuple[int, int, torch.Tensor]
        ] = []  # (length, count, token index [count * length])
        self.cu: torch.Tensor | None = None  # [segments + 1] int32 (varlen), empty ones left out
        self.max_length = max(starts_by_len, default=0)
        if len(starts_by_len) == 1:
            ((length, starts),) = starts_by_len.items()
            if starts == list(range(0, self.num_tokens, length)):
                self.tiled_length = length
                return
        if varlen and device.type == "cuda":
            cu = sorted({*cu_seqlens})
            self.cu = torch.tensor(cu, dtype=torch.int32).to(device)
        for length, starts in starts_by_len.items():
            index = (torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1)
            self.groups.append((length, len(starts), index.to(device)))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Non-causal attention inside each segment; q/k/v [N, H, D] -> [N, H, D]."""
    n, heads, dim = q.shape
    assert n == segments.num_tokens, (n, segments.num_tokens)
    if segments.tiled_length is not None:
        length = segments.tiled_length
        qs, ks, vs = (t.view(n // length, length, heads, dim).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(n, heads, dim)
    if segments.cu is not None and q.dtype in (torch.bfloat16, torch.float16):
        cu, length = segments.cu, segments.max_length
        return varlen_attn(q, k, v, cu, cu, length, length)
    out = torch.empty_like(q)
    for length, count, index in segments.groups:  # segments of equal length run as one batch
        qs, ks, vs = (t[index].view(count, length, heads, dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # [count, H, L, D]
        out[index] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out


def check_vision_parallel(cfg: VisionConfig, size: int) -> None:
    """``ModelLoadError`` naming the numbers unless the vision tower splits over ``size`` ranks:
    its attention heads and its MLP's intermediate size divide by ``size``."""
    if size < 1:
        raise ModelLoadError(f"vision tensor parallel size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"the {cfg.num_heads} vision attention heads")
    if cfg.intermediate_size % size:
        problems.append(f"the vision intermediate size {cfg.intermediate_size}")
    if problems:
        raise ModelLoadError(
            f"vision tensor parallel size {size} does not divide {', '.join(problems)}"
        )


class FusedQKVParallelLinear(nn.Linear):
    """This rank's heads of a fused ``[3 * hidden, hidden]`` q/k/v projection, whose rows are
    [q heads | k heads | v heads]: its rows of each third, stacked (``tp_shards`` names the three
    slices, which the loader reads and concatenates). The output is [q | k | v] of this rank's
    heads; no collective. In a group of 1 it is the plain ``nn.Linear``."""

    def __init__(self, hidden_size: int, tp: TensorParallel) -> None:
        part = tp.split(hidden_size, dim=0)
        super().__init__(hidden_size, 3 * part.size, bias=True)
        if tp.size > 1:
            shards = tuple(
                Shard(0, i * hidden_size + part.start, part.size, 3 * hidden_size) for i in range(3)
            )
            self.tp_shards = {"weight": shards, "bias": shards}


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp.size  # this rank's
        self.head_dim = cfg.head_dim
        self.qkv = FusedQKVParallelLinear(cfg.hidden_size, tp)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = ops.rotary_qk_fp32(
            self.qkv(x), cos, sin, self.num_heads, self.head_dim
        )  # [N, H, D] each
        return self.proj(segment_attention(q, k, v, segments).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg, tp)
        self.mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True, tp=tp
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Segments,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the block's output is their sum, which the next norm adds.

        ``residual`` is the stream so far (None: ``x`` is the tower's input). Each residual add
        runs inside the following RMSNorm (``add_forward``, as the decoder layers do): the same
        bf16 sums, one pass over the activations fewer.
        """
        h, residual = self.norm1.add_forward(x, residual)
        h, residual = self.norm2.add_forward(self.attn(h, cos, sin, segments), residual)
        return self.mlp(h), residual


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embed_dim = cfg.hidden_size
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=False
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [N, C*T*P*P] -> [N, hidden]; a stride==kernel conv is a matmul over the flattened patch
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(pixel_values.to(weight.dtype), weight)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The merged tokens of the last block's ``x + residual`` (the add fused with ``ln_q``)."""
        return self.mlp(self.ln_q.add_forward(x, residual)[0].view(-1, self.merged_dim))


def hw_positions(grids: GridList, merge: int) -> torch.Tensor:
    """(row, col) of every patch in processor order, [N, 2] int64."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_layout(grids: GridList, merge: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """Permutation of merge units grouping each window contiguously, and window cu_seqlens in patches."""
    index_parts: list[torch.Tensor] = []
    cu: list[int] = [0]
    base = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        units = torch.arange(t * gh * gw).view(t, gh, gw)
        nh, nw = -(-gh // window_units), -(-gw // window_units)
        padded = F.pad(units, (0, nw * window_units - gw, 0, nh * window_units - gh), value=-1)
        windows = padded.view(t, nh, window_units, nw, window_units).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(t * nh * nw, window_units * window_units)
        for window in windows:
            kept = window[window >= 0]
            if kept.numel():
                index_parts.append(kept + base)
                cu.append(cu[-1] + kept.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(index_parts), cu


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_vision_parallel(cfg, tp.size)
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(cfg, tp) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grids: GridList) -> torch.Tensor:
        """Embeddings for every merged patch of the images, [sum(t*h*w/merge^2), out_hidden]."""
        return self.forward_layout(pixel_values, self.layout(grids, pixel_values.device))

    def layout(self, grids: GridList, device: torch.device) -> VisionLayout:
        """A forward's host work for ``grids``: windows, segments, rotary tables on ``device``."""
        merge = self.cfg.spatial_merge_size
        unit = merge * merge
        window_units = self.cfg.window_size // merge // self.cfg.patch_size
        window_index, cu_window = window_layout(grids, merge, window_units)
        window_index = window_index.to(device)
        cu_full = [0]
        for t, h, w in grids:  # full attention within each frame
            for _ in range(t):
                cu_full.append(cu_full[-1] + h * w)
        cos, sin = self.rotary(hw_positions(grids, merge).to(device))

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0] // unit, unit, -1)[window_index].reshape(t.shape[0], -1)

        return VisionLayout(
            window_index,
            torch.argsort(window_index),
            Segments(cu_full, device),
            Segments(cu_window, device, varlen=True),
            permute(cos),
            permute(sin),
        )

    def forward_layout(self, pixel_values: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        """``forward`` with its layout built: device work only (what a CUDA graph captures)."""
        unit = self.cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values)  # [N, hidden]
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[layout.window_index].reshape(n, -1)
        residual = None
        for i, block in enumerate(self.blocks):
            is_full = i in self.cfg.fullatt_block_indexes
            segments = layout.full if is_full else layout.windowed
            x, residual = block(x, residual, layout.cos, layout.sin, segments)
        assert residual is not None, "the tower has blocks"
        merged = self.merger(x, residual)  # [N / unit, out_hidden] in window order
        return merged[layout.inverse_index]


@dataclass(frozen=True)
class VisionLayout:
    """What a ViT forward over one list of grids needs besides the pixels (``layout``)."""

    window_index: torch.Tensor  # [N / unit] merge unit at each window-order position
    inverse_index: torch.Tensor  # [N / unit] window-order position of each merge unit
    full: Segments  # the full-attention blocks' segments (one per frame)
    windowed: Segments  # the other blocks' (one per window)
    cos: torch.Tensor  # [N, rotary dim] in window order
    sin: torch.Tensor
