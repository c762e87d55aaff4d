"""Regexes, EBNF grammars, choices and structural tags (vLLM's structured outputs) compiled by
the grammar cache with the bundled tiny model's tokenizer, and masked sampling under them."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from services.common.errors import InvalidRequestError
from services.common.paths import BUNDLED_MODEL
from services.common.types import Grammar, GrammarKind, SamplingParams
from services.common.wire import sampling_params_from_proto, sampling_params_to_proto
from services.engine.config import ModelConfig
from services.engine.grammar import GrammarCache, apply_grammar_masks, without_surrogates
from services.router.openai_params import structured_output
from services.router.openai_schema import CompletionBody

CHOICES = ['say "hi"', "back\\slash", "two\nlines", "tab\tend", "café ☕", "", "yes", "yes!"]


def triggered_tag(schema: dict) -> dict:
    """A structural tag (xgrammar's format) whose one tag <f>...</f> holds JSON of ``schema``."""
    content = {"type": "json_schema", "json_schema": schema}
    tag = {"begin": "<f>", "content": content, "end": "</f>"}
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [tag]},
    }


NEW_TAG = triggered_tag(
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
)
OLD_TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<f>",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
            },
            "end": "</f>",
        }
    ],
    "triggers": ["<f>"],
}


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(BUNDLED_MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_MODEL / "tokenizer.json"))


def grammar_of(**structured_outputs) -> Grammar:
    body = CompletionBody(prompt="x", structured_outputs=structured_outputs)
    grammar, _ = structured_output(body)
    assert grammar is not None
    return grammar


def accepts(cache: GrammarCache, grammar: Grammar, text: str) -> bool:
    """Whether ``text`` is a whole output of ``grammar`` (EOS may follow it)."""
    matcher = cache.matcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def sample(cache: GrammarCache, grammar: Grammar, seed: int, max_tokens: int = 64) -> list[int]:
    """Tokens sampled from random logits under ``grammar``, up to its EOS or ``max_tokens``."""
    vocab_size = ModelConfig.from_dir(BUNDLED_MODEL).text.vocab_size
    generator = torch.Generator().manual_seed(seed)
    matchers = [(0, cache.matcher(grammar))]
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(1, vocab_size, generator=generator) * 4
        apply_grammar_masks(logits, matchers)
        sampled = torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)
        assert matchers[0][1].accept_token(int(sampled[0]))
        tokens.append(int(sampled[0]))
        if matchers[0][1].is_terminated():
            break
    return tokens


def text_and_end(tokenizer, tokens: list[int]) -> tuple[str, bool]:
    """The text before EOS, and whether the tokens ended with EOS."""
    eos = set(ModelConfig.from_dir(BUNDLED_MODEL).eos_token_ids)
    has_eos = bool(tokens) and tokens[-1] in eos
    assert not eos & set(tokens[:-1])  # EOS only where the grammar is complete
    return tokenizer.decode(tokens[:-1] if has_eos else tokens), has_eos


@pytest.mark.parametrize("seed", range(6))
def test_sampling_under_a_regex_matches_it_in_full(cache, tokenizer, seed):
    grammar = Grammar(GrammarKind.REGEX, "[a-c]{3,5}(-[0-9]+)?")
    text, has_eos = text_and_end(tokenizer, sample(cache, grammar, seed))
    if has_eos:
        assert re.fullmatch("[a-c]{3,5}(-[0-9]+)?", text), text
    else:  # cut by the token budget: a prefix of a match
        assert cache.matcher(grammar).accept_string(text), text


def test_a_regex_takes_the_whole_output(cache):
    grammar = Grammar(GrammarKind.REGEX, "[a-c]{3,5}")
    assert accepts(cache, grammar, "abc") and accepts(cache, grammar, "cabba")
    assert not accepts(cache, grammar, "ab")
    assert not cache.matcher(grammar).accept_string("abcabc")
    assert not cache.matcher(grammar).accept_string("xabc")


def test_choices_compile_to_an_alternation_of_their_exact_strings(cache, tokenizer):
    grammar = grammar_of(choice=CHOICES)
    assert grammar.kind is GrammarKind.EBNF
    for choice in CHOICES:
        assert accepts(cache, grammar, choice), choice
    for other in ("say hi", "back\\\\slash", "two lines", "ye", "café", "yes!!", "x"):
        assert not accepts(cache, grammar, other), other
    picked = set()
    for seed in range(12):
        text, has_eos = text_and_end(tokenizer, sample(cache, grammar, seed))
        assert has_eos and text in CHOICES, text
        picked.add(text)
    assert len(picked) > 1  # sampled, not one fixed path


def test_an_ebnf_grammar_starts_at_root(cache, tokenizer):
    grammar = grammar_of(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+')
    assert accepts(cache, grammar, "(1,22,3)") and not accepts(cache, grammar, "(1,)")
    for seed in range(4):
        text, has_eos = text_and_end(tokenizer, sample(cache, grammar, seed))
        assert not has_eos or re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", text), text


STRING_TAG = triggered_tag({"type": "string"})
ANY_CHARACTER = {  # a grammar, and the text before and after a place any character may take
    "bounded string": (
        Grammar(GrammarKind.JSON_SCHEMA, '{"type": "string", "maxLength": 1}'),
        b'"',
        b'"',
    ),
    "string": (Grammar(GrammarKind.JSON_SCHEMA, '{"type": "string"}'), b'"', b'"'),
    "json object": (Grammar(GrammarKind.JSON_OBJECT), b'{"', b'": 1}'),
    "regex dot": (Grammar(GrammarKind.REGEX, "a.b"), b"a", b"b"),
    "regex negated": (Grammar(GrammarKind.REGEX, "a[^x]b"), b"a", b"b"),
    "ebnf negated": (Grammar(GrammarKind.EBNF, 'root ::= "a" [^x] "b"'), b"a", b"b"),
    "ebnf range": (Grammar(GrammarKind.EBNF, 'root ::= "a" [\\0-\\U0010ffff] "b"'), b"a", b"b"),
    "structural tag": (
        Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps(STRING_TAG)),
        b'x <f>"',
        b'"</f>',
    ),
}


@pytest.mark.parametrize("name", ANY_CHARACTER)
def test_any_character_is_utf8_never_a_surrogate(cache, name):
    grammar, before, after = ANY_CHARACTER[name]
    for char in ("é", "中", "😀", "\ue000", "\U0010ffff"):
        assert accepts(cache, grammar, before + char.encode() + after), char
    # U+D800 and U+DFFF as UTF-8 would write them: bytes no UTF-8 decoder reads as text
    for surrogate in (b"\xed\xa0\x80", b"\xed\xbf\xbf"):
        assert not cache.matcher(grammar).accept_string(before + surrogate), surrogate


def test_classes_are_rewritten_without_surrogates_and_strings_are_not():
    text = 'r ::= ([^\\0-\\x1f\\"\\]] "[^a]" [a\\-z] [\\0-\\U0010ffff] [\\ud800-\\udfff])'
    assert without_surrogates(text) == (
        'r ::= ([^\\u0000-\\u001f\\u0022\\u005d\\ud800-\\udfff] "[^a]" '
        "[\\u0061\\u002d\\u007a] [\\u0000-\\ud7ff\\ue000-\\U0010ffff] [\\ud800-\\udfff])"
    )


@pytest.mark.parametrize("tag", [NEW_TAG, OLD_TAG], ids=["format", "structures"])
def test_structural_tags_constrain_only_inside_their_tags(cache, tag):
    grammar = grammar_of(structural_tag=json.dumps(tag))
    assert grammar.kind is GrammarKind.STRUCTURAL_TAG
    assert accepts(cache, grammar, 'free text <f>{"a": 1}</f> more text')
    assert not cache.matcher(grammar).accept_string('text <f>{"b": 1}')
    assert grammar_of(structural_tag=tag) == Grammar(
        GrammarKind.STRUCTURAL_TAG, json.dumps(tag, separators=(",", ":"))
    )


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        (GrammarKind.REGEX, "[a-c", "the regex cannot be compiled: Regex parsing error"),
        (GrammarKind.REGEX, "(?=a)b", "Lookahead is not supported"),
        (GrammarKind.REGEX, r"(a)\1", "Backreference is not supported"),
        (GrammarKind.EBNF, 'start ::= "a"', 'The root rule with name "root" is not found'),
        (GrammarKind.EBNF, "root ::= undefined", 'Rule "undefined" is not defined'),
        (GrammarKind.EBNF, 'root ::= "a" |', "the EBNF grammar cannot be compiled"),
        (GrammarKind.STRUCTURAL_TAG, "{not json", "the structural tag cannot be compiled: not"),
        (
            GrammarKind.STRUCTURAL_TAG,
            json.dumps({"type": "structural_tag", "format": {"type": "nope"}}),
            "Format type not recognized: nope",
        ),
        (
            GrammarKind.STRUCTURAL_TAG,
            json.dumps({**OLD_TAG, "triggers": None}),
            "structures must be a list of {begin, schema, end} objects",
        ),
        (
            GrammarKind.STRUCTURAL_TAG,
            json.dumps({**OLD_TAG, "extra": 1}),
            "takes type",
        ),
        (
            GrammarKind.STRUCTURAL_TAG,
            json.dumps({"type": "structural_tag", "format": {"a": [[[[[[]]]]]]}})
            .replace("[[", "[" * 20)
            .replace("]]", "]" * 20),
            "structural tag nests",
        ),
    ],
)
def test_what_cannot_compile_is_refused_with_xgrammars_reason(cache, kind, spec, reason):
    with pytest.raises(InvalidRequestError) as info:
        cache.compile(Grammar(kind, spec))
    assert info.value.param == "grammar"
    assert reason in info.value.message and ".cc:" not in info.value.message


@pytest.mark.parametrize(
    "grammar",
    [
        Grammar(GrammarKind.REGEX, ""),
        Grammar(GrammarKind.EBNF, ""),
        Grammar(GrammarKind.STRUCTURAL_TAG, ""),
        Grammar(GrammarKind.REGEX, "a+", is_strict=True),
        Grammar(GrammarKind.JSON_OBJECT, is_strict=True),
    ],
)
def test_sampling_params_refuse_a_spec_that_does_not_fit_its_kind(grammar):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(grammar=grammar).validate()
    assert info.value.param == "grammar"


@pytest.mark.parametrize(
    "grammar",
    [
        Grammar(GrammarKind.REGEX, "[a-c]{3,5}"),
        Grammar(GrammarKind.EBNF, 'root ::= "é" | "\\x0a"'),
        Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps(NEW_TAG)),
    ],
)
def test_every_kind_crosses_the_wire(grammar):
    params = SamplingParams(grammar=grammar)
    params.validate()
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
