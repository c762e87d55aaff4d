"""vLLM's structured-output extensions through the whole system (prefill samples the first
token under the grammar, decode the rest) at temperature 1: a regex matches the whole output,
a choice returns one of its strings, ``guided_json`` validates; a grammar that does not
compile is a 400 naming its field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.common.types import Grammar, GrammarKind
from tests.e2e.openai_api.helpers import assert_400, chat, create_concurrently

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REGEX = "[a-c]{3,5}"
CHOICES = ["yes", "no", 'say "maybe"']
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}


def test_a_regex_holds_over_seeds(client, model_name, grammar_cache):
    calls = [
        dict(
            model=model_name,
            messages=chat("Three letters."),
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": REGEX}},
        )
        for seed in range(4)
    ]
    choices = [reply.choices[0] for reply in create_concurrently(client, calls, 4)]
    for choice in choices:
        text = choice.message.content
        if choice.finish_reason == "length":
            assert grammar_cache.matcher(Grammar(GrammarKind.REGEX, REGEX)).accept_string(text)
        else:
            assert choice.finish_reason == "stop" and re.fullmatch(REGEX, text), text
    assert any(choice.finish_reason == "stop" for choice in choices)


def test_a_choice_returns_one_of_its_strings(client, model_name):
    for seed, field in enumerate(("guided_choice", "structured_outputs")):
        value = CHOICES if field == "guided_choice" else {"choice": CHOICES}
        reply = client.completions.create(
            model=model_name,
            prompt="Answer:",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={field: value},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.text in CHOICES, choice
    stream = client.chat.completions.create(
        model=model_name,
        messages=chat("Answer."),
        max_tokens=8,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) in CHOICES
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_guided_json_validates(client, model_name, grammar_cache):
    reply = client.chat.completions.create(
        model=model_name,
        messages=chat("Reply in JSON."),
        max_tokens=48,
        temperature=1.0,
        seed=3,
        extra_body={"guided_json": SCHEMA},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "length":
        grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
        assert grammar_cache.matcher(grammar).accept_string(choice.message.content)
    else:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_grammar_that_does_not_compile_is_a_400_naming_it(system, model_name):
    body = {
        "model": model_name,
        "prompt": "x",
        "structured_outputs": {"grammar": 'start ::= "a"'},
    }
    error = assert_400(system, "completions", body)
    assert error["param"] == "structured_outputs.grammar"
    assert 'root rule with name "root" is not found' in error["message"]
