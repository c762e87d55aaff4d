"""A byte-level BPE tokenizer of a given vocabulary size, grown from the bundled one.

The system benchmark's checkpoint has the real model's vocabulary size (152,064 for
Qwen2.5-VL-7B), so its ``lm_head`` and the sampler work over as many logits as the real
model's, and every id the model samples must decode to text. The bundled tokenizer has 2,048
ids (its special tokens at 0..6); ``grow_tokenizer`` appends BPE merges until the vocabulary
has the wanted size: each new token is the concatenation of two existing ones (drawn with a
seeded generator, so the file is the same on every run) and comes with the merge that makes
it, after the trained merges. Every new token is made of byte-level alphabet characters, so
it decodes to its bytes like a trained one, and encoding still applies the trained merges
first; prompts are counted with this file on the client and on the server alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DRAWS_PER_ROUND = 1 << 16


def grow_tokenizer(tokenizer_json: str, vocab_size: int, seed: int = 0) -> str:
    """``tokenizer_json`` (a byte-level BPE ``tokenizer.json``) with merges appended until it has
    ``vocab_size`` ids, special tokens included; its own text when it already has that many."""
    data = json.loads(tokenizer_json)
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only a BPE tokenizer can be grown, not {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    special = {token["content"] for token in data.get("added_tokens", ())}
    num_ids = len(vocab.keys() | special)
    if vocab_size < num_ids:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {num_ids} ids")
    if vocab_size == num_ids:
        return tokenizer_json
    assert max(vocab.values()) == num_ids - 1, "the ids are not dense"
    base = [token for token in vocab if token not in special]
    merges: list = model["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    rng = np.random.default_rng(seed)
    next_id = num_ids
    while next_id < vocab_size:
        for left, right in rng.integers(len(base), size=(DRAWS_PER_ROUND, 2)).tolist():
            token = base[left] + base[right]
            if token in vocab:
                continue
            vocab[token] = next_id
            merges.append([base[left], base[right]] if as_pairs else f"{base[left]} {base[right]}")
            next_id += 1
            if next_id == vocab_size:
                break
    return json.dumps(data, ensure_ascii=False)


def write_grown_tokenizer(source: Path, out: Path, vocab_size: int) -> None:
    """``grow_tokenizer`` of the ``tokenizer.json`` at ``source``, written to ``out``."""
    text = grow_tokenizer(source.read_text(encoding="utf-8"), vocab_size)
    out.write_text(text, encoding="utf-8")
