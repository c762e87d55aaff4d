"""``spans.rope_delta`` (plain Python, the tokenizer's) equals the delta of
``rope.mrope_positions`` (the position table prefill and decode build)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.model.rope import mrope_positions
from services.engine.model.spans import ImageSpan, rope_delta

MERGE = 2


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, list[ImageSpan]]:
    """A prompt length and its image spans: text runs (maybe empty) between images."""
    spans, cursor = [], 0
    for _ in range(draw(st.integers(0, 4))):
        cursor += draw(st.integers(0, 6))
        t = draw(st.integers(1, 2))
        h, w = (MERGE * draw(st.integers(1, 5)) for _ in range(2))
        length = t * (h // MERGE) * (w // MERGE)
        spans.append(ImageSpan(cursor, length, (t, h, w)))
        cursor += length
    return cursor + draw(st.integers(0, 6)), spans


@settings(max_examples=200, deadline=None)
@given(prompts())
def test_rope_delta_matches_the_position_table(prompt: tuple[int, list[ImageSpan]]) -> None:
    num_tokens, spans = prompt
    _, expected = mrope_positions(num_tokens, spans, MERGE)
    assert rope_delta(num_tokens, spans, MERGE) == expected


def test_text_only_prompts_have_no_delta() -> None:
    assert rope_delta(0, [], MERGE) == 0
    assert rope_delta(7, [], MERGE) == 0


def test_a_wide_image_moves_the_text_after_it() -> None:
    # one 1x4x8 grid: 8 tokens on positions 0..3 (w/2 = 4 wide), text continues from 4
    span = ImageSpan(0, 8, (1, 4, 8))
    assert rope_delta(10, [span], MERGE) == (4 + 2) - 10
