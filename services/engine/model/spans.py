"""Image spans of a prompt and the M-RoPE position delta they give, in plain Python.

The tokenizer needs only the delta (``rope_delta``), not the position table; this module
imports no torch so the tokenizer process never loads it. ``rope.mrope_positions`` builds
the table itself and gives the same delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder run inside a request's token ids (request-global offset)."""

    offset: int  # index of the first image token in the prompt
    length: int  # number of image tokens = t * h * w / merge**2
    grid_thw: tuple[int, int, int]  # patch grid before merging


def rope_delta(num_tokens: int, spans: Sequence[ImageSpan], spatial_merge_size: int) -> int:
    """``max(position) + 1 - num_tokens`` of ``mrope_positions`` (0 for an empty prompt)."""
    if not num_tokens:
        return 0
    cursor = 0  # next token index
    current = 0  # next position value
    max_position = -1
    for span in sorted(spans, key=lambda s: s.offset):
        assert span.offset >= cursor, "image spans overlap"
        text_len = span.offset - cursor
        if text_len:
            max_position = current + text_len - 1
        current += text_len
        t, h, w = span.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        assert t * gh * gw == span.length, f"span length {span.length} != grid {span.grid_thw}"
        max_position = max(max_position, current + max(t, gh, gw) - 1)
        current += max(gh, gw)
        cursor = span.offset + span.length
    assert cursor <= num_tokens, "image span past the end of the prompt"
    if num_tokens > cursor:
        max_position = max(max_position, current + num_tokens - cursor - 1)
    return max_position + 1 - num_tokens
