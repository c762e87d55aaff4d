"""Structured outputs through the whole system: JSON schemas and JSON objects hold at
temperature 1 (streamed too, with an image); a schema that cannot compile is a 400."""

from __future__ import annotations

import json
import random
import types

import jsonschema
import pytest

from services.common.types import GrammarKind
from services.router.openai_params import response_format
from tests.e2e.openai_api.helpers import CASES, assert_400, chat, create_concurrently

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NUM_SCHEMAS = 50  # random nested schemas per layout, sampled at temperature 1


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["enum", "integer", "number", "boolean", "string"]
    kind = rng.choice(kinds + (["object", "array"] if depth < 2 else []))
    if kind == "object":
        names = rng.sample(["a", "b", "c", "id", "name", "tags"], rng.randint(1, 3))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        return {
            "type": "object",
            "properties": properties,
            "required": names[: rng.randint(0, len(names))],
            "additionalProperties": False,
        }
    if kind == "array":
        low = rng.randint(0, 2)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + 2}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, True, None], 3)}
    if kind in ("integer", "number"):
        low = rng.randint(-50, 50)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    return {"type": "boolean"}


def check_structured(grammar_cache, grammar, choice) -> None:
    text = choice.message.content
    if choice.finish_reason == "length":
        assert grammar_cache.matcher(grammar).accept_string(text), text
        return
    assert choice.finish_reason == "stop", choice.finish_reason
    value = json.loads(text)
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        jsonschema.validate(value, json.loads(grammar.spec))
    else:
        assert isinstance(value, dict)


def test_json_schemas_hold_at_temperature_one(system, client, model_name, grammar_cache):
    rng = random.Random(39)
    schemas: list[dict] = []
    while len(schemas) < NUM_SCHEMAS:  # objects at the top, anything below
        schema = random_schema(rng)
        if schema.get("type") == "object":
            schemas.append(schema)
    formats = [
        {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}
        for i, s in enumerate(schemas)
    ] + [{"type": "json_object"}] * 2

    calls = [
        dict(
            model=model_name,
            messages=chat("Reply in JSON.", []),
            max_tokens=96,
            temperature=1.0,
            response_format=fmt,
        )
        for fmt in formats
    ]
    choices = [reply.choices[0] for reply in create_concurrently(client, calls, 4)]
    for fmt, choice in zip(formats, choices, strict=True):
        check_structured(grammar_cache, response_format(fmt), choice)
    assert any(choice.finish_reason == "stop" for choice in choices)


def test_json_object_streams_with_an_image(client, model_name, grammar_cache):
    text, images = CASES["one_image"]
    fmt = {"type": "json_object"}
    stream = client.chat.completions.create(
        model=model_name,
        messages=chat(text, images),
        max_tokens=64,
        temperature=1.0,
        seed=5,
        response_format=fmt,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reason = chunks[-1].choices[0].finish_reason
    message = types.SimpleNamespace(content=content)
    check_structured(
        grammar_cache,
        response_format(fmt),
        types.SimpleNamespace(message=message, finish_reason=reason),
    )


@pytest.mark.parametrize(
    "schema",
    [{"type": "no-such-type"}, {"properties": {"a": {"$ref": "#/nowhere"}}}, "nested"],
)
def test_bad_schema_is_a_400_naming_response_format(system, model_name, schema):
    if schema == "nested":
        schema = {"type": "object"}
        for _ in range(40):
            schema = {"type": "array", "items": schema}
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    body = {"model": model_name, "messages": chat("hi"), "response_format": fmt}
    assert assert_400(system, "chat/completions", body)["param"] == "response_format"
