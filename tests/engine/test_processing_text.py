"""Tokenizer, chat template and detokenizer against transformers' AutoTokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from services.common.errors import InvalidRequestError
from services.engine.processing import text as text_module
from services.engine.processing.chat import iter_image_parts
from services.engine.processing.detokenize import byte_level_char_to_byte, token_bytes_table
from services.engine.processing.text import (
    PlaceholderSpan,
    TextProcessor,
    expand_image_placeholders,
)
from services.engine.processing.token_bound import CHUNK_CHARS, MAX_COMPOSED, TokenBound
from tests.conftest import TINY_MODEL_DIR

TINY_DIR = TINY_MODEL_DIR

TEXTS = [
    "Hello, world! How are you today?",
    "Le café du coin ouvre à sept heures; über die Brücke; niño, São Paulo, Łódź.",
    "今天天气很好，我们去公园散步。山の上の小さな駅で。오늘은 비가 와서",
    "Emoji: 🙂 🚀 👍🏽 ❤️ 🇫🇷 👩‍💻 and symbols € ≤ ∞ → …",
    "def f(x: int) -> int:\n    return x ** 2  # 12345\n\tprint(f'{x!r}')\n",
    "<|im_start|>user\nhi<|im_end|>\n<|vision_start|><|image_pad|><|vision_end|>",
    "   leading and trailing spaces   \n\n\n",
    "Zalgo: ẑ̷̛a̶l̵g̸o and NFD e\u0301 vs NFC é",
]

IMAGE_PART = {"type": "image"}
CONVERSATIONS = {
    "text_only": [{"role": "user", "content": "What is the capital of Italy?"}],
    "multi_turn": [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "Count to three."},
    ],
    "system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
    ],
    "images": [
        {
            "role": "user",
            "content": [
                IMAGE_PART,
                {"type": "text", "text": "Compare this picture"},
                {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}},
                {"type": "text", "text": " with that one."},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "The first is darker."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, IMAGE_PART]},
    ],
    "system_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [IMAGE_PART]},
    ],
}


@pytest.fixture(scope="module")
def processor() -> TextProcessor:
    return TextProcessor.from_dir(TINY_DIR)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_DIR))


def test_special_token_ids(processor):
    assert processor.vocab_size <= 2048
    assert (processor.vision_start_token_id, processor.vision_end_token_id) == (3, 4)
    assert (processor.image_token_id, processor.video_token_id) == (5, 6)
    assert 2 in processor.eos_token_ids
    assert processor.special_token_ids == frozenset(range(7))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_auto_tokenizer(processor, reference, text):
    ids = processor.encode(text)
    assert ids == reference.encode(text)
    assert processor.decode(ids) == reference.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_apply_chat_template(processor, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = processor.render_chat(messages, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_render_chat_layout(processor):
    text = processor.render_chat(CONVERSATIONS["images"])
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 3
    assert text.endswith(
        "And this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    system = processor.render_chat(CONVERSATIONS["system"], add_generation_prompt=False)
    assert system == (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
        "<|im_start|>user\nColour of the sky?<|im_end|>\n"
    )
    assert len(list(iter_image_parts(CONVERSATIONS["images"]))) == 3


def test_expand_image_placeholders(processor):
    ids = processor.encode(processor.render_chat(CONVERSATIONS["images"]))
    expanded, spans = processor.expand_image_placeholders(ids, [4, 16, 6])
    assert len(expanded) == len(ids) + 3 + 15 + 5
    assert [span.length for span in spans] == [4, 16, 6]
    pad = processor.image_token_id
    for span in spans:
        assert expanded[span.offset - 1] == processor.vision_start_token_id
        assert expanded[span.offset : span.offset + span.length] == [pad] * span.length
        assert expanded[span.offset + span.length] == processor.vision_end_token_id
    assert [t for t in expanded if t != pad] == [t for t in ids if t != pad]


def test_expand_image_placeholders_edges():
    assert expand_image_placeholders([9, 5, 5], 5, [2, 1]) == (
        [9, 5, 5, 5],
        [PlaceholderSpan(1, 2), PlaceholderSpan(3, 1)],
    )
    assert expand_image_placeholders([1, 2], 5, []) == ([1, 2], [])
    with pytest.raises(InvalidRequestError, match="2 image placeholders but 1 images"):
        expand_image_placeholders([5, 7, 5], 5, [4])
    with pytest.raises(InvalidRequestError, match="0 image placeholders but 1 images"):
        expand_image_placeholders([7], 5, [4])


def run_detokenizer(processor, ids, skip_special_tokens):
    detokenizer = processor.detokenizer(skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.step(token_id) for token_id in ids]
    return deltas, detokenizer.finish()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_matches_full_decode(processor, text, skip_special_tokens):
    ids = processor.encode(text)
    deltas, tail = run_detokenizer(processor, ids, skip_special_tokens)
    assert "".join(deltas) + tail == processor.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tail == ""
    assert not any("\ufffd" in delta for delta in deltas)


def test_detokenizer_holds_split_characters(processor):
    ids = processor.encode("🙂")
    assert len(ids) > 1  # the emoji's four bytes span several byte-level tokens
    deltas, tail = run_detokenizer(processor, ids, skip_special_tokens=True)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂" and tail == ""


def test_detokenizer_flushes_incomplete_character(processor):
    ids = processor.encode("a🙂")[:-1]  # drop the token that completes the emoji
    deltas, tail = run_detokenizer(processor, ids, skip_special_tokens=True)
    assert "".join(deltas) == "a" and tail == "\ufffd"
    assert "".join(deltas) + tail == processor.decode(ids)


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_matches_decode_on_random_ids(processor, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(processor.vocab_size + 5) for _ in range(300)]  # some ids out of range
    for skip_special_tokens in (True, False):
        deltas, tail = run_detokenizer(processor, ids, skip_special_tokens)
        assert "".join(deltas) + tail == processor.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


def test_byte_level_alphabet_matches_tokenizers():
    char_to_byte = byte_level_char_to_byte()
    assert set(char_to_byte) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(char_to_byte.values()) == list(range(256))


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 7}], "messages[1].content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": ["plain"]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages_raise(processor, messages, param):
    with pytest.raises(InvalidRequestError) as info:
        processor.render_chat(messages)
    assert info.value.param == param
    assert param.split(".")[-1].split("[")[0] in info.value.message


LONG_TEXTS = [
    "hello world, how are you? " * 60,
    "x" * 3000,
    "今天天气很好，我们去公园散步。" * 100,
    "line one\nline two\r\n\tindented <|im_end|> 12345 🙂 e\u0301 " * 40,
]


@pytest.mark.parametrize("text", TEXTS + LONG_TEXTS)
def test_encode_under_a_limit_equals_encode(processor, text):
    ids = processor.encode(text)
    assert processor.encode(text, max_len=len(ids) + 1) == ids
    chat = [{"role": "user", "content": text}]
    chat_ids = processor.encode_chat(chat)
    assert processor.encode_chat(chat, max_len=len(chat_ids) + 1) == chat_ids


@pytest.mark.parametrize("text", LONG_TEXTS)
def test_a_prompt_at_the_limit_is_refused_with_its_length(processor, text):
    for encode, param in (
        (lambda max_len: processor.encode(text, max_len=max_len), "prompt"),
        (
            lambda max_len: processor.encode_chat(
                [{"role": "user", "content": text}], max_len=max_len
            ),
            "messages",
        ),
    ):
        num_tokens = len(encode(None))
        with pytest.raises(InvalidRequestError) as info:
            encode(num_tokens)
        assert (
            info.value.message
            == f"prompt has {num_tokens} tokens; the context limit is {num_tokens}"
        )
        assert info.value.param == param


class CountedTokenizer:
    """A tokenizer that adds the characters it is asked to encode to ``counts``."""

    def __init__(self, tokenizer: Tokenizer, counts: list[int]) -> None:
        object.__setattr__(self, "_tokenizer", tokenizer)
        object.__setattr__(self, "_counts", counts)

    def encode(self, text: str, add_special_tokens: bool = True):
        self._counts[0] += len(text)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._tokenizer, name, value)


@pytest.fixture
def counted(monkeypatch) -> tuple[TextProcessor, list[int]]:
    """A processor every tokenizer of which (the plain copy too) counts the characters encoded."""
    counts = [0]

    class Tokenizers:
        @staticmethod
        def from_file(path: str) -> CountedTokenizer:
            return CountedTokenizer(Tokenizer.from_file(path), counts)

        @staticmethod
        def from_str(json_text: str) -> CountedTokenizer:
            return CountedTokenizer(Tokenizer.from_str(json_text), counts)

    monkeypatch.setattr(text_module, "Tokenizer", Tokenizers)
    return TextProcessor.from_dir(TINY_DIR), counts


@pytest.mark.parametrize("text", ["x" * (50 << 20), "hello world " * (4 << 20)])
def test_a_huge_text_is_refused_without_tokenizing_it(counted, text):
    processor, counts = counted
    tokenizer = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    max_token_chars = TokenBound.from_tokenizer(
        tokenizer, token_bytes_table(tokenizer)
    ).max_token_chars
    # At most the text of max_len tokens of the longest kind, and two chunks (as TokenBound's
    # own tests bound it): nothing near the text's length.
    work_bound = MAX_COMPOSED * max_token_chars * 4096 + 2 * CHUNK_CHARS
    for call in (
        lambda: processor.encode(text, max_len=4096),
        lambda: processor.encode_chat([{"role": "user", "content": text}], max_len=4096),
    ):
        counts[0] = 0
        with pytest.raises(
            InvalidRequestError,
            match=r"^prompt has at least \d+ tokens; the context limit is 4096$",
        ):
            call()
        assert counts[0] <= work_bound < len(text) // 10
    for call in (  # the counting sees both tokenizers' work
        lambda: processor.encode(text[:1000]),
        lambda: processor.encode_chat([{"role": "user", "content": text[:1000]}]),
    ):
        counts[0] = 0
        call()
        assert counts[0] >= 1000
