"""The bundled tokenizer grown to the real model's vocabulary size (152,064 ids)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from benchmarks.vocab_tokenizer import grow_tokenizer
from tests.conftest import TINY_MODEL_DIR

BUNDLED = (TINY_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")


def test_grown_to_the_real_vocabulary_every_new_id_is_two_old_tokens_bytes() -> None:
    bundled = Tokenizer.from_str(BUNDLED)
    text = grow_tokenizer(BUNDLED, 152_064)
    grown = Tokenizer.from_str(text)
    merges = {tuple(pair) for pair in json.loads(text)["model"]["merges"]}
    assert grown.get_vocab_size(with_added_tokens=True) == 152_064
    assert max(grown.get_vocab(with_added_tokens=True).values()) == 152_063
    for token in SPECIAL_TOKENS:
        assert grown.token_to_id(token) == bundled.token_to_id(token)
    for token_id in (0, 100, 2047):  # the trained ids are kept
        assert grown.id_to_token(token_id) == bundled.id_to_token(token_id)
    for token_id in (2048, 77_777, 152_063):
        token = grown.id_to_token(token_id)
        assert token and token not in bundled.get_vocab()
        halves = [(token[:i], token[i:]) for i in range(1, len(token))]
        made_by = [pair for pair in halves if pair in merges]  # the merge that makes it
        assert len(made_by) == 1, token
        left, right = (bundled.token_to_id(half) for half in made_by[0])
        assert grown.decode([token_id]) == bundled.decode([left, right])
    prompt = "Describe the picture: a red car, two trees and 42 people near the school."
    assert grown.decode(grown.encode(prompt).ids) == prompt


def test_growing_is_deterministic_and_a_full_tokenizer_is_kept() -> None:
    assert grow_tokenizer(BUNDLED, 3000) == grow_tokenizer(BUNDLED, 3000)
    assert grow_tokenizer(BUNDLED, 3000, seed=1) != grow_tokenizer(BUNDLED, 3000)
    assert grow_tokenizer(BUNDLED, 2048) == BUNDLED
    with pytest.raises(ValueError, match="below"):
        grow_tokenizer(BUNDLED, 1000)
