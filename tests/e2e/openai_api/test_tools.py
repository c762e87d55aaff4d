"""Tools through the whole system (on the dp2 layout): required and named tool choices give
calls that follow the tools' schemas; a tool result turn is answered (streams:
``test_tool_streams.py``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.openai_api.helpers import chat, create_concurrently, only_on

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city"],
}
TIME_PARAMETERS = {  # bounded, so a sampled call ends well within max_tokens
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": parameters}}
    for name, parameters in PARAMETERS.items()
]


def only_on_dp2(request) -> None:
    only_on(request, "dp2", "tools run once, on the dp2 layout")


def tool_request(model: str, question: str, max_tokens: int, **fields) -> dict:
    """A chat request offering ``TOOLS``."""
    return dict(model=model, messages=chat(question), max_tokens=max_tokens, tools=TOOLS, **fields)


def test_required_and_named_tool_calls_follow_the_tools(request, client, model_name):
    only_on_dp2(request)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [("required", False)] * 3 + [(named, True)] * 3
    calls = [
        tool_request(
            model_name,
            "What is the weather in Oslo?",
            96,
            temperature=1.0,
            tool_choice=tool_choice,
            parallel_tool_calls=is_parallel,
        )
        for tool_choice, is_parallel in choices
    ]
    replies = create_concurrently(client, calls, 3)
    for (tool_choice, _), choice in zip(choices, (r.choices[0] for r in replies), strict=True):
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if tool_choice is named:
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_tool_result_turn_is_answered(request, client, model_name):
    only_on_dp2(request)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *chat("What is the weather in Oslo?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 8 degrees."},
    ]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=8, temperature=0.0, tools=TOOLS
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools and the tool turns are in the prompt
