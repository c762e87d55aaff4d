"""``page_keys``: what makes two prompts' pages share a prefix-cache key and what does not."""

from __future__ import annotations

import hashlib

import pytest

from services.common.prefix_keys import KEY_BYTES, page_keys
from services.common.types import ImageSpanRef

PAGE = 16
IMAGE_TOKEN = 5


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def image_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def with_image(
    n: int, offset: int, length: int, name: str = "x", grid=(1, 6, 8)
) -> tuple[list[int], list[ImageSpanRef]]:
    """``n`` tokens with an image's placeholders at ``[offset, offset + length)``."""
    ids = tokens(n)
    ids[offset : offset + length] = [IMAGE_TOKEN] * length
    return ids, [ImageSpanRef(offset, length, image_hash(name), grid)]


def first_difference(a: list[bytes], b: list[bytes]) -> int:
    assert len(a) == len(b)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.parametrize("n", [0, 1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE - 1, 5 * PAGE])
def test_only_full_pages_get_keys(n):
    keys = page_keys(tokens(n), [], PAGE)
    assert len(keys) == n // PAGE
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)


def test_equal_prompts_give_equal_keys():
    ids, spans = with_image(6 * PAGE + 3, 37, 12)
    again = with_image(6 * PAGE + 3, 37, 12)
    assert page_keys(ids, spans, PAGE) == page_keys(tuple(again[0]), tuple(again[1]), PAGE)


@pytest.mark.parametrize("position", [0, PAGE - 1, 2 * PAGE, 3 * PAGE + 7, 5 * PAGE - 1])
def test_a_changed_token_changes_its_page_and_every_later_one(position):
    ids = tokens(5 * PAGE + 9)
    changed = list(ids)
    changed[position] += 1
    keys, other = page_keys(ids, [], PAGE), page_keys(changed, [], PAGE)
    page = position // PAGE
    assert keys[:page] == other[:page]
    assert all(a != b for a, b in zip(keys[page:], other[page:], strict=True))


def test_a_changed_token_past_the_last_full_page_changes_no_key():
    ids = tokens(5 * PAGE + 9)
    changed = list(ids)
    changed[5 * PAGE + 4] += 1
    assert page_keys(ids, [], PAGE) == page_keys(changed, [], PAGE)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(37, 12), (2 * PAGE, PAGE), (3 * PAGE - 1, 2), (0, 5), (PAGE + 3, 3 * PAGE)],
)
def test_a_different_image_after_the_same_text_changes_keys_from_its_first_page(offset, length):
    # the placeholder tokens are equal: only the image's content hash tells the two apart
    ids, spans_x = with_image(7 * PAGE, offset, length, "x")
    same_ids, spans_y = with_image(7 * PAGE, offset, length, "y")
    assert ids == same_ids
    keys_x, keys_y = page_keys(ids, spans_x, PAGE), page_keys(ids, spans_y, PAGE)
    first = offset // PAGE
    assert first_difference(keys_x, keys_y) == first
    assert all(a != b for a, b in zip(keys_x[first:], keys_y[first:], strict=True))


def test_a_different_second_image_leaves_the_pages_before_it_equal():
    ids = tokens(8 * PAGE)
    ids[10:22] = ids[70:82] = [IMAGE_TOKEN] * 12
    first = ImageSpanRef(10, 12, image_hash("x"), (1, 6, 8))
    second = [ImageSpanRef(70, 12, image_hash(name), (1, 6, 8)) for name in ("y", "z")]
    keys_y = page_keys(ids, [first, second[0]], PAGE)
    keys_z = page_keys(ids, [first, second[1]], PAGE)
    assert first_difference(keys_y, keys_z) == 70 // PAGE


def test_an_image_only_in_the_partial_last_page_changes_no_key():
    ids, spans_x = with_image(3 * PAGE + 10, 3 * PAGE + 2, 6, "x")
    _, spans_y = with_image(3 * PAGE + 10, 3 * PAGE + 2, 6, "y")
    assert page_keys(ids, spans_x, PAGE) == page_keys(ids, spans_y, PAGE)
    assert page_keys(ids, spans_x, PAGE) == page_keys(ids, [], PAGE)


def test_an_image_changes_the_keys_of_equal_tokens_without_it():
    ids, spans = with_image(4 * PAGE, 20, 12)
    assert first_difference(page_keys(ids, spans, PAGE), page_keys(ids, [], PAGE)) == 1


def test_equal_image_bytes_with_a_different_grid_give_different_keys():
    ids, spans = with_image(5 * PAGE, 37, 12, grid=(1, 6, 8))
    _, regridded = with_image(5 * PAGE, 37, 12, grid=(1, 8, 6))
    keys, other = page_keys(ids, spans, PAGE), page_keys(ids, regridded, PAGE)
    assert first_difference(keys, other) == 37 // PAGE
    assert all(a != b for a, b in zip(keys[2:], other[2:], strict=True))


def test_equal_image_bytes_at_a_different_offset_give_different_keys():
    # equal tokens, the span named one position later: the image's place is part of the key
    ids = tokens(5 * PAGE)
    ids[36:50] = [IMAGE_TOKEN] * 14
    here = [ImageSpanRef(37, 12, image_hash("x"), (1, 6, 8))]
    later = [ImageSpanRef(38, 12, image_hash("x"), (1, 6, 8))]
    keys, other = page_keys(ids, here, PAGE), page_keys(ids, later, PAGE)
    assert first_difference(keys, other) == 37 // PAGE
    assert all(a != b for a, b in zip(keys[2:], other[2:], strict=True))


def test_the_same_image_at_the_same_place_gives_equal_keys():
    ids, spans = with_image(5 * PAGE, 37, 12, "x")
    copy = [ImageSpanRef(37, 12, image_hash("x"), (1, 6, 8))]
    assert spans == copy and spans[0] is not copy[0]
    assert page_keys(ids, spans, PAGE) == page_keys(list(ids), copy, PAGE)


def test_no_key_is_shared_between_page_sizes():
    ids = [7] * (8 * PAGE)  # one repeated token: pages of the same size hold equal tokens
    small, large = page_keys(ids, [], PAGE // 2), page_keys(ids, [], PAGE)
    assert len(small) == 2 * len(large)
    assert not set(small) & set(large)
