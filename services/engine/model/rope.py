"""Rotary position embeddings of Qwen2.5-VL and its 3D (M-RoPE) position ids.

Text positions are one integer per token; image tokens get (t, h, w) positions on the
merged patch grid, offset by the position where the image starts, and the text after
an image continues from ``start + max(h, w)``. Decode continues with
``seq_len - 1 + rope_delta`` on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.model.spans import ImageSpan


def mrope_positions(
    num_tokens: int, spans: Sequence[ImageSpan], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """3D positions ``[3, num_tokens]`` int64 for a prompt and its rope delta."""
    chunks: list[torch.Tensor] = []
    cursor = 0  # next token index
    current = 0  # next position value
    for span in sorted(spans, key=lambda s: s.offset):
        assert span.offset >= cursor, "image spans overlap"
        text_len = span.offset - cursor
        chunks.append(torch.arange(current, current + text_len).expand(3, -1))
        current += text_len
        t, h, w = span.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        assert t * gh * gw == span.length, f"span length {span.length} != grid {span.grid_thw}"
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        chunks.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
        current += max(gh, gw)
        cursor = span.offset + span.length
    assert cursor <= num_tokens, "image span past the end of the prompt"
    chunks.append(torch.arange(current, current + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(chunks, dim=1).to(torch.int64)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MRotaryEmbedding(torch.nn.Module):
    """Text rotary embedding with per-axis frequency sections (M-RoPE); ``interleaved``
    (Qwen3-VL): frequency j takes the h axis when j % 3 == 1 and j < 3 * section[1], the w
    axis when j % 3 == 2 and j < 3 * section[2], else the t axis."""

    def __init__(
        self, head_dim: int, theta: float, mrope_section: Sequence[int], interleaved: bool = False
    ) -> None:
        super().__init__()
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [3, T] -> cos, sin [T, head_dim] in dtype
        freqs = positions.to(torch.float32)[:, :, None] * self.inv_freq.float()  # [3, T, D/2]
        if self.interleaved:
            picked = freqs[0].clone()
            for axis in (1, 2):
                index = slice(axis, 3 * self.mrope_section[axis], 3)
                picked[..., index] = freqs[axis, ..., index]
            freqs = picked  # [T, D/2]
        else:
            parts = freqs.split(self.mrope_section, dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos/sin [T, D]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class VisionRotaryEmbedding(torch.nn.Module):
    """2D axial rotary embedding of the ViT: half the head dim for rows, half for columns."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.spatial_dim, self.theta = head_dim // 2, theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        exponents = (
            torch.arange(0, self.spatial_dim, 2, dtype=torch.float32, device=device)
            / self.spatial_dim
        )
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(self, hw_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # hw_positions [N, 2] -> cos, sin [N, head_dim] fp32
        freqs = hw_positions.to(torch.float32)[..., None] * self.inv_freq.float()  # [N, 2, D/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()
