"""The grammar cache and the token mask on the logits (xgrammar, CPU, the bundled tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.paths import BUNDLED_MODEL
from services.common.types import Grammar, GrammarKind, SamplingParams
from services.engine.config import ModelConfig
from services.engine.grammar import GrammarCache, GrammarMasks, apply_grammar_masks
from services.router.openai_params import response_format

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["x"]}},
    "required": ["n", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(BUNDLED_MODEL, max_entries=2)


def schema_grammar(schema: dict) -> Grammar:
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema), is_strict=True)


def test_cache_compiles_once_and_evicts_the_least_recent(cache):
    first = cache.compile(schema_grammar(SCHEMA))
    assert cache.compile(schema_grammar(SCHEMA)) is first
    cache.compile(Grammar(GrammarKind.JSON_OBJECT))
    cache.compile(schema_grammar({"type": "array"}))
    assert cache.compile(schema_grammar(SCHEMA)) is not first


@pytest.mark.parametrize("max_length", [None, 5])
def test_strings_take_no_raw_control_character(cache, max_length):
    string = {"type": "string"} | ({} if max_length is None else {"maxLength": max_length})
    grammar = schema_grammar({"type": "object", "properties": {"a": string}, "required": ["a"]})
    for text, is_json in (('{"a": "ab\x13"}', False), ('{"a": "abc"}', True)):
        assert cache.matcher(grammar).accept_string(text) is is_json, text


@pytest.mark.parametrize("spec", ['{"type": "nope"}', "{not json", "[" * 40 + "]" * 40])
def test_a_schema_that_cannot_compile_names_the_grammar(cache, spec):
    with pytest.raises(InvalidRequestError) as info:
        cache.compile(Grammar(GrammarKind.JSON_SCHEMA, spec))
    assert info.value.param == "grammar"


def test_masked_sampling_writes_valid_json_and_leaves_free_rows_alone(cache):
    """Decode's path: ``GrammarMasks`` masks the constrained row, its matcher accepts the
    sampled token; the free rows are left as they were."""
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    vocab_size, eos = config.text.vocab_size, set(config.eos_token_ids)
    generator = torch.Generator().manual_seed(0)
    masks = GrammarMasks(3, vocab_size, torch.device("cpu"))
    matchers = [(1, cache.matcher(schema_grammar(SCHEMA)))]
    tokens: list[int] = []
    for _ in range(200):
        logits = torch.randn(3, vocab_size, generator=generator)
        free = logits[[0, 2]].clone()
        masks.apply(logits, matchers)
        assert torch.equal(logits[[0, 2]], free)
        sampled = torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)
        masks.accept([matchers[0][1]], [int(sampled[1])])
        tokens.append(int(sampled[1]))
        if matchers[0][1].is_terminated():
            break
    assert tokens[-1] in eos and not eos & set(tokens[:-1])
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_MODEL / "tokenizer.json"))
    value = json.loads(tokenizer.decode(tokens[:-1]))
    assert value["c"] == "x" and 0 <= value["n"] <= 9 and set(value) == {"n", "c"}


def test_batch_masks_equal_one_matcher_at_a_time(cache):
    """``GrammarMasks`` (xgrammar's batch matcher, reused buffers, rows in any order, a
    terminated matcher left alone) masks exactly as ``apply_grammar_masks`` does, step after
    step."""
    vocab_size = ModelConfig.from_dir(BUNDLED_MODEL).text.vocab_size
    generator = torch.Generator().manual_seed(1)
    masks = GrammarMasks(5, vocab_size, torch.device("cpu"))
    grammar = schema_grammar(SCHEMA)
    ours = [(3, cache.matcher(grammar)), (0, cache.matcher(grammar)), (4, cache.matcher(grammar))]
    theirs = [(row, cache.matcher(grammar)) for row, _ in ours]
    for _ in range(40):
        logits = torch.randn(5, vocab_size, generator=generator)
        expected = logits.clone()
        masks.apply(logits, ours)
        apply_grammar_masks(expected, theirs)
        assert torch.equal(logits, expected)
        if all(m.is_terminated() for _, m in ours):
            break
        sampled = torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)
        picked = [int(sampled[row]) for row, _ in ours]
        masks.accept([m for _, m in ours], picked)
        for (_, matcher), token in zip(theirs, picked, strict=True):
            if not matcher.is_terminated():
                assert matcher.accept_token(token)
    assert any(m.is_terminated() for _, m in ours)


def test_response_format_maps_to_a_grammar():
    assert response_format(None) is None and response_format({"type": "text"}) is None
    assert response_format({"type": "json_object"}) == Grammar(GrammarKind.JSON_OBJECT)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    grammar = response_format(fmt)
    assert grammar.is_strict and json.loads(grammar.spec) == SCHEMA
    for bad in (
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": 1},
    ):
        with pytest.raises(InvalidRequestError) as info:
            response_format(bad)
        assert info.value.param == "response_format"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")],
)
def test_grammar_refuses_what_would_override_it(fields, param):
    params = SamplingParams(grammar=Grammar(GrammarKind.JSON_OBJECT), **fields)
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.param == param


def test_wire_round_trip_keeps_the_grammar():
    from services.common.wire import sampling_params_from_proto, sampling_params_to_proto

    params = SamplingParams(grammar=schema_grammar(SCHEMA))
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).grammar is None
