"""vLLM's structured-output extensions on both endpoints: ``structured_outputs`` (json, regex,
choice, grammar, structural_tag, json_object) and the older ``guided_*`` fields. Each reaches
prefill and decode as its grammar; two constraints, a spec that does not compile and a
malformed field are 400s naming the field, before any worker sees the request.

Fake workers (they do not apply the grammar); the grammar check compiles for real in the
router's compiler child. Outputs under each kind: ``tests/engine/test_grammar_kinds.py`` and
``tests/e2e/openai_api/test_structured_extensions.py``.
"""

from __future__ import annotations

import json

import pytest

from services.router.openai_params import GUIDED_FIELDS, structured_output
from services.router.openai_schema import ChatCompletionBody, CompletionBody
from tests.router.http_helpers import CHAT_PATH, COMPLETIONS_PATH, assert_400, body_for

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f>"],
        "tags": [
            {
                "begin": "<f>",
                "content": {"type": "json_schema", "json_schema": SCHEMA},
                "end": "</f>",
            }
        ],
    },
}
COMPACT_SCHEMA = json.dumps(SCHEMA, separators=(",", ":"))

# (fields, the grammar's kind and spec as prefill and decode get them)
ACCEPTED = [
    ({"structured_outputs": {"regex": "[a-c]{3,5}"}}, ("regex", "[a-c]{3,5}")),
    ({"guided_regex": "[a-c]{3,5}"}, ("regex", "[a-c]{3,5}")),
    (
        {"structured_outputs": {"choice": ["yes", 'a "b"']}},
        ("ebnf", 'root ::= "yes" | "a \\"b\\""'),
    ),
    ({"guided_choice": ["yes", "no"]}, ("ebnf", 'root ::= "yes" | "no"')),
    ({"structured_outputs": {"grammar": 'root ::= "x"+'}}, ("ebnf", 'root ::= "x"+')),
    ({"guided_grammar": 'root ::= "x"+'}, ("ebnf", 'root ::= "x"+')),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", COMPACT_SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", COMPACT_SCHEMA)),
    ({"guided_json": SCHEMA}, ("json_schema", COMPACT_SCHEMA)),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    (
        {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
        ("structural_tag", json.dumps(TAG)),
    ),
    (
        {"structured_outputs": {"structural_tag": TAG}, "response_format": {"type": "text"}},
        ("structural_tag", json.dumps(TAG, separators=(",", ":"))),
    ),
]


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize(("fields", "expected"), ACCEPTED)
async def test_each_constraint_reaches_prefill_and_decode_as_its_grammar(
    http, cluster, path, fields, expected
):
    response = await http.post(path, json=body_for(path, max_tokens=4, **fields))
    assert response.status_code == 200, response.text
    [reserve] = cluster.decode.reserved.values()
    [prefill] = cluster.prefill.requests
    for params in (reserve.sampling_params, prefill.sampling_params):
        grammar = params.grammar
        assert (grammar.kind, grammar.spec, grammar.is_strict) == (*expected, False)


TWO = [
    (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        ["structured_outputs.regex", "structured_outputs.choice"],
    ),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
        ["response_format", "structured_outputs.json"],
    ),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, None),
    ({"guided_regex": "a", "guided_choice": ["b"]}, ["guided_regex", "guided_choice"]),
    (
        {"response_format": {"type": "json_object"}, "guided_grammar": 'root ::= "a"'},
        ["response_format", "guided_grammar"],
    ),
]


@pytest.mark.parametrize(("fields", "names"), TWO)
async def test_two_constraints_are_a_400_naming_both(http, cluster, fields, names):
    names = names or ["structured_outputs.regex", "guided_json"]
    message = await assert_400(
        http, COMPLETIONS_PATH, body_for(COMPLETIONS_PATH, **fields), names[1]
    )
    assert message.startswith(f"{names[0]} and {names[1]} each constrain the output")
    assert not cluster.decode.reserved and not cluster.tokenizer.servicer.requests


BAD = [
    ({"structured_outputs": {"regex": "[a-c"}}, "structured_outputs.regex", "Unclosed '['"),
    ({"guided_regex": "(?=a)b"}, "guided_regex", "Lookahead is not supported"),
    ({"guided_regex": ""}, "guided_regex", "must not be empty"),
    (
        {"structured_outputs": {"grammar": 'start ::= "a"'}},
        "structured_outputs.grammar",
        'root rule with name "root" is not found',
    ),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", 'Rule "nothing" is not defined'),
    (
        {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {}}}},
        "structured_outputs.structural_tag",
        "the structural tag cannot be compiled",
    ),
    (
        {"structured_outputs": {"structural_tag": "{not json"}},
        "structured_outputs.structural_tag",
        "not JSON",
    ),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json", "cannot be compiled"),
    ({"structured_outputs": {"json": "[1, 2"}}, "structured_outputs.json", "a JSON schema"),
    ({"guided_json": "7"}, "guided_json", "a JSON schema"),
    ({"guided_choice": []}, "guided_choice", "at least one string"),
    ({"structured_outputs": {"choice": ["a", "\ud800"]}}, "structured_outputs.choice[1]", "lone"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "only true"),
    ({"structured_outputs": {}}, "structured_outputs", "must set one of json, regex"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", "longer than"),
    ({"guided_choice": ["a" * 40000] * 2}, "guided_choice", "longer than 65536 characters as a"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"guided_choice": ["a"], "min_tokens": 1}, "min_tokens", "cannot be combined"),
    (
        {"structured_outputs": {"choice": ["a"], "min_tokens": 2}},
        "structured_outputs.min_tokens",
        "unknown fields are refused",
    ),
]


@pytest.mark.parametrize(  # the two endpoints in turn: they share the checks
    ("path", "fields", "param", "reason"),
    [((CHAT_PATH, COMPLETIONS_PATH)[i % 2], *case) for i, case in enumerate(BAD)],
)
async def test_a_bad_constraint_is_a_400_naming_its_field(
    http, cluster, path, fields, param, reason
):
    # as JSON text: a lone surrogate is an escape there, which httpx's json= cannot encode
    body = json.dumps(body_for(path, **fields))
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert reason in error["message"], error
    assert not cluster.decode.reserved and not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_decoding_backend": "xgrammar"},
        {"guided_whitespace_pattern": " "},
        {"structural_tag": json.dumps(TAG)},  # vLLM's older top-level name: not taken
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
    ],
)
async def test_vllm_fields_not_built_are_refused_as_unknown(http, cluster, fields):
    [name] = fields
    inner = fields[name] if name == "structured_outputs" else {}
    param = "structured_outputs.disable_any_whitespace" if inner else name
    message = await assert_400(http, CHAT_PATH, body_for(CHAT_PATH, **fields), param)
    assert "unknown fields are refused" in message


async def test_a_constraint_cannot_join_a_required_tool_call(http, cluster):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = body_for(CHAT_PATH, tools=[tool], tool_choice="required", guided_regex="a+")
    message = await assert_400(http, CHAT_PATH, body, "guided_regex")
    assert "cannot be combined with tool_choice required" in message
    auto = body_for(CHAT_PATH, tools=[tool], guided_regex="a+", max_tokens=2)
    assert (await http.post(CHAT_PATH, json=auto)).status_code == 200


def test_guided_fields_mean_what_structured_outputs_fields_mean():
    values = {
        "json": SCHEMA,
        "regex": "[0-9]+",
        "choice": ["a", "b\n"],
        "grammar": 'root ::= "a"',
    }
    for guided, name in GUIDED_FIELDS.items():
        for body_type in (ChatCompletionBody, CompletionBody):
            extra = {"messages": []} if body_type is ChatCompletionBody else {}
            old = body_type(**extra, **{guided: values[name]})
            new = body_type(**extra, structured_outputs={name: values[name]})
            assert structured_output(old) == (structured_output(new)[0], guided)


async def test_openapi_documents_the_structured_output_fields(http):
    schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
    for body in ("ChatCompletionBody", "CompletionBody"):
        names = set(schemas[body]["properties"])
        assert {"structured_outputs", *GUIDED_FIELDS} <= names, body
    inner = schemas["StructuredOutputsBody"]
    assert set(inner["properties"]) == {
        "json",
        "regex",
        "choice",
        "grammar",
        "structural_tag",
        "json_object",
    }
    assert inner["additionalProperties"] is False
