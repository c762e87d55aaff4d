"""Tools on /v1/chat/completions: the hermes parser, the Qwen2.5 tool prompt, the call
grammar, and the HTTP contract against the fake workers."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from services.common.paths import BUNDLED_MODEL
from services.engine.grammar import GrammarCache
from services.router.openai_prompt import chat_messages
from services.router.openai_schema import ChatCompletionBody, ChatMessageBody
from services.router.tool_parser_json import parse_hermes
from services.router.tool_parsers import ParsedCall
from services.router.tools import MAX_TOOLS, ToolMode, tool_plan
from tests.router.fakes import EOS_ID, TEXT, char_ids
from tests.router.http_helpers import CHAT_PATH, assert_400

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
NAMES = ("get_weather", "get_time")
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def block(text: str) -> str:
    return f"<tool_call>\n{text}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (block(CALL), "", [("get_weather", '{"city": "Oslo"}')]),
        (
            "Let me look.\n" + block(CALL) + "\n" + block('{"name": "get_time", "arguments": {}}'),
            "Let me look.",
            [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
        ),
        (
            block('{"name": "get_weather", "arguments": {"city": [{"a": "é"}]}}'),
            "",
            [("get_weather", '{"city": [{"a": "é"}]}')],
        ),
        (block("{not json"), block("{not json"), []),
        (
            block('{"name": "rm_rf", "arguments": {}}'),
            block('{"name": "rm_rf", "arguments": {}}'),
            [],
        ),
        (block('{"name": "get_time", "arguments": "x"}'), None, []),
        ("<tool_call>\n" + CALL, "", [("get_weather", '{"city": "Oslo"}')]),  # no closing tag
        ("<tool_call>\n" + CALL[:-4], "", [("get_weather", '{"city": "Osl')]),  # cut short
    ],
)
def test_hermes_parser(text, content, calls):
    parsed = parse_hermes(text, NAMES)
    assert parsed.content == (text if content is None else content)
    assert parsed.calls == tuple(ParsedCall(n, a) for n, a in calls)


def test_hermes_parser_keeps_later_calls_as_text_when_not_parallel():
    text = block(CALL) + "\n" + block('{"name": "get_time", "arguments": {}}')
    parsed = parse_hermes(text, NAMES, 1)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == block('{"name": "get_time", "arguments": {}}')


def test_tool_turns_render_as_qwen25_does():
    messages = [
        ChatMessageBody(role="user", content="Weather in Oslo?"),
        ChatMessageBody(
            role="assistant",
            content=None,
            tool_calls=[
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        ),
        ChatMessageBody(role="tool", content="rain", tool_call_id="c1"),
        ChatMessageBody(role="tool", content="noon", tool_call_id="c2"),
    ]
    chat = asyncio.run(chat_messages(messages, None, [WEATHER, TIME]))
    dicts = [
        {"role": m.role, "content": [{"type": "text", "text": p.text} for p in m.content]}
        for m in chat
    ]
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER, TIME))
    assert TEXT.render_chat(dicts) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n"
        + block(CALL)
        + "\n"
        + block('{"name": "get_time", "arguments": {}}')
        + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n"
        "<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("fields", "is_array", "names"),
    [
        ({"tool_choice": "required"}, True, NAMES),
        ({"tool_choice": "required", "parallel_tool_calls": False}, False, NAMES),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            False,
            ("get_time",),
        ),
    ],
)
def test_call_grammar_accepts_exactly_calls_of_the_chosen_tools(fields, is_array, names):
    body = ChatCompletionBody(
        messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME], **fields
    )
    plan = tool_plan(body)
    assert plan.names == names and plan.mode in (ToolMode.REQUIRED, ToolMode.NAMED)
    schema = json.loads(plan.grammar.spec)
    cache = GrammarCache(BUNDLED_MODEL)
    for call in (
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '{"name": "get_time", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"city": "Rome"}}',
    ):
        text = f"[{call}]" if is_array else call
        is_named = json.loads(call)["name"] in names
        is_valid = is_named and jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert cache.matcher(plan.grammar).accept_string(text) == is_valid, text
        assert bool(plan.parse(text).calls) == is_named, text  # the grammar checks the rest


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 128, **fields}


async def test_auto_returns_parsed_calls_and_lists_the_tools(http, cluster):
    cluster.script.output_ids = [*char_ids("Sure.\n" + block(CALL)), EOS_ID]
    response = await http.post(CHAT_PATH, json=chat_body(tools=[WEATHER, TIME]))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    system = cluster.tokenizer.servicer.requests[-1].chat.messages[0]
    assert system.role == "system" and '"name": "get_time"' in system.content[1].text


async def test_required_output_is_calls_with_null_content(http, cluster):
    cluster.script.output_ids = [*char_ids(f"[{CALL}]"), EOS_ID]
    body = chat_body(tools=[WEATHER], tool_choice="required")
    choice = (await http.post(CHAT_PATH, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_tool_choice_none_returns_text(http, cluster):
    cluster.script.output_ids = [*char_ids(block(CALL)), EOS_ID]
    body = chat_body(tools=[WEATHER], tool_choice="none")
    choice = (await http.post(CHAT_PATH, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == block(CALL)
    assert "tool_calls" not in choice["message"]


def _history(**tool_message) -> list[dict]:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1", **tool_message},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": [WEATHER] * 2}, "tools[1].function.name"),
        ({"tools": [{**TIME, "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{**TIME, "type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [TIME] * (MAX_TOOLS + 1)}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [TIME], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [TIME],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (
            {
                "tools": [{**TIME, "function": {"name": "f", "parameters": {"type": "no-such"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": _history(tool_call_id="c9")}, "messages[2].tool_call_id"),
        ({"messages": _history(tool_call_id=None)}, "messages[2].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    _history()[1]
                    | {
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ]
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
async def test_bad_tool_fields_are_400s_naming_the_field(http, cluster, fields, param):
    body = chat_body(**fields)
    if body["messages"][-1].get("tool_call_id", "") is None:
        del body["messages"][-1]["tool_call_id"]
    await assert_400(http, CHAT_PATH, body, param)
    assert not cluster.decode.reserved
