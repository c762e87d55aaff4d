"""Streamed tool calls through the whole system (on the dp2 layout), read by the official
client: with required and named tool choices (the call grammar makes even the tiny random
model call), ``delta.tool_calls`` reassemble to the calls the whole response gives for the
same greedy request, and follow the tools' schemas; with ``auto`` (free random text), the
stream says what the whole response says."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.e2e.openai_api.test_tools import PARAMETERS, only_on_dp2, tool_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def streamed(client, **request):
    """The stream's choice as the client assembles it, and its chunks."""
    state = ChatCompletionStreamState()
    chunks = []
    for chunk in client.chat.completions.create(stream=True, **request):
        state.handle_chunk(chunk)
        chunks.append(chunk)
    return state.current_completion_snapshot.choices[0], chunks


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize(
    ("tool_choice", "is_parallel"), [("required", True), ("required", False), (NAMED, True)]
)
def test_streamed_calls_are_the_whole_responses(
    request, client, model_name, tool_choice, is_parallel
):
    only_on_dp2(request)
    ask = tool_request(
        model_name,
        "What is the time in Oslo?",
        96,
        temperature=0.0,
        tool_choice=tool_choice,
        parallel_tool_calls=is_parallel,
    )
    whole = client.chat.completions.create(**ask).choices[0]
    choice, chunks = streamed(client, **ask)
    assert choice.finish_reason == whole.finish_reason == "tool_calls"
    assert calls_of(choice.message) == calls_of(whole.message)
    assert choice.message.content in (None, "") and whole.message.content is None
    for name, arguments in calls_of(choice.message):
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    if tool_choice is NAMED:
        assert [name for name, _ in calls_of(choice.message)] == ["get_time"]
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id.startswith("call_") and entries[0].type == "function"
    assert all(e.id is None and e.function.name is None for e in entries[1:] if e.index == 0)


def test_auto_streams_what_the_whole_response_says(request, client, model_name):
    only_on_dp2(request)
    ask = tool_request(model_name, "What is the weather in Oslo?", 48, temperature=0.0)
    whole = client.chat.completions.create(**ask).choices[0]
    choice, _ = streamed(client, **ask)
    assert choice.finish_reason == whole.finish_reason
    assert (choice.message.content or None) == (whole.message.content or None)
    assert calls_of(choice.message) == calls_of(whole.message)
