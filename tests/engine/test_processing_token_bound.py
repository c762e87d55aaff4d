"""TokenBound: exact counts where it says exact, lower bounds that never pass the true
count, work bounded by the limit, and the Unicode facts its proof rests on."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from tokenizers import Tokenizer

from services.common.errors import ModelLoadError
from services.engine.processing.detokenize import byte_level_char_to_byte, token_bytes_table
from services.engine.processing.token_bound import (
    _NFC_SAFE_RE,
    CL100K_PATTERN,
    MAX_COMPOSED,
    QWEN2_PATTERN,
    TokenBound,
)
from tests.conftest import TINY_MODEL_DIR

TINY_JSON = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())


def split_then_bytes(pattern: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    }


PRE_TOKENIZERS = {
    "tiny": TINY_JSON["pre_tokenizer"],  # Digits, then ByteLevel with the GPT-2 regex
    "qwen2": split_then_bytes(QWEN2_PATTERN),
    "cl100k": split_then_bytes(CL100K_PATTERN),
    "unknown": {  # not proved to split at cuts: bounded as one uncut stretch
        "type": "Sequence",
        "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    },
}


def tokenizer_with(**overrides) -> Tokenizer:
    return Tokenizer.from_str(json.dumps({**TINY_JSON, **overrides}))


BYTE_CHAR = {b: ch for ch, b in byte_level_char_to_byte().items()}


def byte_chars(text: str) -> str:
    return "".join(BYTE_CHAR[b] for b in text.encode())


def with_merges(model: dict, pairs: list[tuple[str, str]]) -> dict:
    """``model`` with the merges of ``pairs`` appended (ranked after its own)."""
    vocab, merges = dict(model["vocab"]), list(model["merges"])
    for left, right in pairs:
        if left in vocab and right in vocab and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    return {**model, "vocab": vocab, "merges": merges}


def byte_model(pairs: list[tuple[str, str]]) -> dict:
    """A BPE over the 256 byte tokens and ``pairs``' merges."""
    vocab = {ch: i for i, ch in enumerate(sorted(BYTE_CHAR.values()))}
    return with_merges({**TINY_JSON["model"], "vocab": vocab, "merges": []}, pairs)


def bound_of(tokenizer: Tokenizer, chunk_chars: int) -> TokenBound:
    return TokenBound.from_tokenizer(
        tokenizer, token_bytes_table(tokenizer), chunk_chars=chunk_chars
    )


def plain(tokenizer: Tokenizer) -> Tokenizer:
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


FRAGMENTS = [
    "hello",
    " world",
    "x",
    "xxxx",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "!",
    "?!",
    "...",
    "'s",
    "'re",
    "123",
    "7",
    "é",
    "e\u0301",
    "\u0301",
    "\u0323\u0302",
    "今天",
    "，",
    "。",
    "가",
    "\u1100\u1161",
    "\u11a8",
    "🙂",
    " 🙂",
    "Ω",
    "\u212a",
    "ǖ",
    "<|im_start|>",
    "<|im_end|>",
    "<|image_pad|>",
    "<|",
    "|>",
    "\u00a0",
    "\u3000",
    "ab\ncd",
    "Brücke",
    "naïve",
    "ﬁ",
    "\u0958",
]


# Merges of every pair of adjacent bytes the fragments can make: a cut that splits a
# pre-token, which the tiny vocabulary might not notice, changes the ids here.
_FRAGMENT_BYTES = sorted({ch for f in FRAGMENTS for ch in byte_chars(f)})
RICH_MODEL = with_merges(
    TINY_JSON["model"], [(a, b) for a in _FRAGMENT_BYTES for b in _FRAGMENT_BYTES]
)


def random_text(rng: random.Random, num_fragments: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(num_fragments))


def check(bound: TokenBound, tokenizer: Tokenizer, pieces: list, max_len: int) -> None:
    true_len = sum(
        1 if isinstance(p, int) else len(tokenizer.encode(p, add_special_tokens=False).ids)
        for p in pieces
    )
    count = bound.count_until(pieces, tokenizer, max_len)
    if count is None:
        assert sum(1 if isinstance(p, int) else len(p) for p in pieces) < max_len
    elif count.is_exact:
        assert count.num_tokens == true_len, pieces
    else:
        assert max_len <= count.num_tokens <= true_len, pieces


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
@pytest.mark.parametrize("chunk_chars", [2, 7, 64])
def test_counts_are_exact_or_sound_lower_bounds(name, chunk_chars):
    tokenizer = tokenizer_with(pre_tokenizer=PRE_TOKENIZERS[name], model=RICH_MODEL)
    plain_tokenizer = plain(tokenizer)
    bound = bound_of(tokenizer, chunk_chars)
    rng = random.Random(f"{name}-{chunk_chars}")
    for _ in range(150):
        text = random_text(rng, rng.randrange(1, 120))
        max_len = rng.choice([1, 2, 8, 30, 100, 400])
        for variant in (tokenizer, plain_tokenizer):
            check(bound, variant, [text], max_len)
        check(bound, plain_tokenizer, [1, text, 2, random_text(rng, 20), 5], max_len)


@pytest.mark.parametrize("name", ["tiny", "qwen2", "cl100k"])
def test_cut_pieces_tokenize_as_the_whole(name):
    """Fact 3 directly: the ids of a text cut at every cut are the ids of the whole."""
    tokenizer = tokenizer_with(pre_tokenizer=PRE_TOKENIZERS[name], model=RICH_MODEL)
    variants = (tokenizer, plain(tokenizer))
    bound = bound_of(tokenizer, 2)
    rng = random.Random(name)
    for _ in range(300):
        text = random_text(rng, rng.randrange(1, 60))
        cuts = [0, *(m.start() for m in bound._cut_re.finditer(text, 1)), len(text)]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
        for variant in variants:
            ids = [i for p in pieces for i in variant.encode(p, add_special_tokens=False).ids]
            assert ids == variant.encode(text, add_special_tokens=False).ids, pieces


def test_unknown_pre_tokenizer_disables_cutting():
    assert bound_of(tokenizer_with(pre_tokenizer=PRE_TOKENIZERS["unknown"]), 64)._cut_re is None
    assert bound_of(tokenizer_with(), 64)._cut_re is not None


class CountingTokenizer:
    """Records how many characters the bound asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.num_chars = 0

    def encode(self, text: str, add_special_tokens: bool = False):
        self.num_chars += len(text)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


HOSTILE = {
    "x": "x" * 300_000,
    "words": " ".join(f"w{i:x}q" for i in range(60_000)),
    "hello": "hello world " * 30_000,
    "lines": "ab\n" * 100_000,
    "cjk": "今天天气很好，我们去公园散步。" * 20_000,
    "combining": "e\u0301" * 150_000,
    "greek": "\u03b5\u0301" * 150_000,  # no NFC-safe character at all
    "jamo": "\u1100\u1161" * 150_000,
    "digits": "1234567890" * 30_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_work_is_bounded_by_the_limit(name):
    tokenizer = tokenizer_with()
    bound = bound_of(tokenizer, 4096)
    max_len = 512
    counting = CountingTokenizer(tokenizer)
    count = bound.count_until([HOSTILE[name]], counting, max_len)
    assert count is not None and count.num_tokens >= max_len and not count.is_exact
    # At most the text of max_len tokens of the longest kind, and two chunks.
    assert counting.num_chars <= MAX_COMPOSED * bound.max_token_chars * max_len + 2 * 4096


def test_long_runs_are_refused_from_their_characters():
    """A run of one letter admits only tokens of that letter: far tighter than max_token_chars."""
    tokenizer = tokenizer_with()
    bound = bound_of(tokenizer, 4096)
    counting = CountingTokenizer(tokenizer)
    text = "x" * (bound.max_token_chars * 1000)  # passes the character bound of 1000 tokens
    count = bound.count_until([text], counting, 1000)
    assert count is not None and count.num_tokens >= 1000 and counting.num_chars == 0


def test_a_prefix_bound_leaves_room_for_a_token_straddling_its_end():
    """Runs of x admit only one-x tokens, but "xxxxxxxy" is one token: a bound on a prefix of
    x's must not count each x it holds as a token of the whole."""
    x, y = byte_chars("x"), byte_chars("y")
    pairs = [(x, y)] + [(x, x * n + y) for n in range(1, 7)]  # right to left: xy, xxy, ...
    tokenizer = tokenizer_with(model=byte_model(pairs))
    for text, num_tokens in (("x" * 7 + "y", 1), (("x" * 7 + "y") * 10, 10)):
        assert len(tokenizer.encode(text).ids) == num_tokens
        count = bound_of(tokenizer, 4).count_until([text], tokenizer, num_tokens + 1)
        assert count == (num_tokens, True)


@pytest.mark.parametrize(
    ("base", "chunk_chars"),
    [("e", 16), ("\u03b5", 4)],  # "e" starts NFC-safe windows; epsilon runs have no safe point
)
def test_a_bound_allows_for_nfc_composing(base, chunk_chars):
    """A base letter and U+0301 compose into one token: 2 code points per token."""
    composed = byte_chars(unicodedata.normalize("NFC", base + "\u0301"))
    tokenizer = tokenizer_with(model=byte_model([(composed[0], composed[1])]))
    text = (base + "\u0301") * 100
    assert len(tokenizer.encode(text).ids) == 100
    count = bound_of(tokenizer, chunk_chars).count_until([text], tokenizer, 101)
    assert count == (100, True)


@pytest.mark.parametrize("num_signs", [64, 200])  # normalized in windows; too long a run for one
def test_a_bound_allows_for_ascii_that_nfc_makes(num_signs):
    """NFC turns the Kelvin sign into "K": the tokens of "KKKKKKKK" can cover its runs."""
    k = byte_chars("K")
    tokenizer = tokenizer_with(model=byte_model([(k, k), (k * 2, k * 2), (k * 4, k * 4)]))
    text = "\u212a" * num_signs
    num_tokens = len(tokenizer.encode(text).ids)
    assert num_tokens == -(-num_signs // 8)
    count = bound_of(tokenizer, 16).count_until([text], tokenizer, num_tokens + 1)
    assert count == (num_tokens, True)


@pytest.mark.parametrize(
    "added",
    [
        {"content": "a b", "lstrip": False, "rstrip": False},
        {"content": "<x>", "lstrip": True, "rstrip": False},
        {"content": "<y>", "lstrip": False, "rstrip": True},
    ],
)
def test_added_tokens_that_may_cross_a_cut_disable_cutting(added):
    token = {"id": 2048, "single_word": False, "normalized": False, "special": True, **added}
    tokenizer = tokenizer_with(added_tokens=[*TINY_JSON["added_tokens"], token])
    assert bound_of(tokenizer, 64)._cut_re is None


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"normalizer": {"type": "NFKC"}}, "normalizer NFKC"),
        (
            {
                "truncation": {
                    "direction": "Right",
                    "max_length": 8,
                    "strategy": "LongestFirst",
                    "stride": 0,
                }
            },
            "truncation",
        ),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "ByteLevel"),
    ],
)
def test_unprovable_tokenizers_are_refused_at_load(overrides, fragment):
    with pytest.raises(ModelLoadError, match=fragment):
        bound_of(tokenizer_with(**overrides), 64)


def test_unicode_facts_the_bound_rests_on():
    """Checked against this Python's Unicode database (the tokenizer's is no newer)."""
    second_elements = set()
    for code in range(0x110000):
        decomposition = unicodedata.decomposition(chr(code))
        if decomposition and not decomposition.startswith("<") and len(decomposition.split()) == 2:
            second_elements.add(chr(int(decomposition.split()[1], 16)))
    second_elements.update(map(chr, range(0x1161, 0x11C3)))  # Hangul vowel and trailing jamo
    for code in range(0x110000):
        ch = chr(code)
        nfd = unicodedata.normalize("NFD", ch)
        assert len(nfd) <= MAX_COMPOSED, hex(code)
        if not ch.isspace():
            assert not any(c.isspace() for c in nfd), hex(code)  # a cut's left side stays non-space
        if code < 128:
            assert ch not in second_elements and nfd == ch  # ASCII never composes or changes
        if _NFC_SAFE_RE.match(ch):
            assert unicodedata.combining(nfd[0]) == 0 and nfd[0] not in second_elements, hex(code)
