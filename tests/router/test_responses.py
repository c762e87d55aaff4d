"""``POST /v1/responses`` over fake workers: the official ``openai`` client's
``responses.create`` (plain, instructions, images, structured output, function calls, streams,
``max_output_tokens``), the raw body and events, and a 400 naming each field this server
refuses."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator

import openai
import pytest

from tests.conftest import image_bytes
from tests.router.conftest import (
    BOUND_S,
    MODEL_NAME,
    Cluster,
    router_config,
    serve_http,
    stop_router,
)
from tests.router.fakes import EOS_ID, char_ids
from tests.router.http_helpers import EXPECTED, assert_400

PATH = "/v1/responses"
BODY = {"model": MODEL_NAME, "input": "Say hello."}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[openai.AsyncOpenAI]:
    app, url = await serve_http(router_config(cluster))
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
    )
    yield client
    await client.close()
    await stop_router(app)


def tool_call_output(cluster: Cluster) -> None:
    cluster.script.output_ids = [*char_ids(f"Sure.\n<tool_call>\n{CALL}\n</tool_call>"), EOS_ID]


def chat_sent(cluster: Cluster) -> list[tuple[str, str]]:
    """The last chat the tokenizer got: (role, its text parts joined) per message."""
    messages = cluster.tokenizer.servicer.requests[-1].chat.messages
    return [(m.role, "".join(p.text for p in m.content)) for m in messages]


async def test_plain_text(client, cluster):
    reply = await client.responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=50, metadata={"run": "7"}
    )
    assert reply.output_text == EXPECTED
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.status == "completed" and reply.incomplete_details is None
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert reply.usage.output_tokens == len(cluster.script.output_ids)
    total = reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.input_tokens > 0 and reply.usage.total_tokens == total
    assert reply.metadata == {"run": "7"} and reply.model == MODEL_NAME
    assert chat_sent(cluster) == [("user", "Say hello.")]


async def test_raw_body_has_no_output_text_and_reports_cached_tokens(http, cluster):
    cluster.prefill.prefix_cached = (4, 0)
    response = await http.post(PATH, json=BODY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert "output_text" not in body  # a client-side convenience, as OpenAI's server sends
    assert body["store"] is False and body["tools"] == [] and body["tool_choice"] == "auto"
    assert body["text"] == {"format": {"type": "text"}}
    assert body["output"][0]["content"][0] == {
        "type": "output_text",
        "text": EXPECTED,
        "annotations": [],
        "logprobs": [],
    }
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


async def test_instructions_come_first_as_a_system_message(client, cluster):
    reply = await client.responses.create(
        model=MODEL_NAME,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "No emoji."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
    )
    assert reply.output_text == EXPECTED and reply.instructions == "Be brief."
    assert chat_sent(cluster) == [("system", "Be brief."), ("system", "No emoji."), ("user", "Hi")]


async def test_image_input_reaches_tokenizer_and_prefill(client, cluster):
    image = image_bytes(40, 30)
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    content = [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": url, "detail": "auto"},
    ]
    reply = await client.responses.create(
        model=MODEL_NAME, input=[{"role": "user", "content": content}]
    )
    assert reply.output_text == EXPECTED
    part = cluster.tokenizer.servicer.requests[0].chat.messages[0].content[1]
    assert part.WhichOneof("part") == "image_header"
    assert part.image_header.content_hash == hashlib.sha256(image).hexdigest()
    assert cluster.prefill.requests[0].images[0].data == image


@pytest.mark.parametrize(
    ("text_format", "expected"),
    [
        (
            {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True},
            ("json_schema", json.dumps(SCHEMA, separators=(",", ":")), True),
        ),
        ({"type": "json_object"}, ("json_object", "", False)),
    ],
)
async def test_text_format_constrains_the_output(http, cluster, text_format, expected):
    response = await http.post(PATH, json={**BODY, "text": {"format": text_format}})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == {"format": text_format}
    [reserve] = cluster.decode.reserved.values()
    grammar = reserve.sampling_params.grammar
    assert (grammar.kind, grammar.spec, grammar.is_strict) == expected


async def test_function_call_and_its_result_sent_back(client, cluster):
    tool_call_output(cluster)
    reply = await client.responses.create(model=MODEL_NAME, input="Weather?", tools=[WEATHER])
    message, call = reply.output
    assert message.type == "message" and reply.output_text == "Sure."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Oslo"}' and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    assert reply.status == "completed" and reply.tools[0].name == "get_weather"
    assert '"name": "get_weather"' in chat_sent(cluster)[0][1]  # the tools, listed

    cluster.script.output_ids = [*char_ids("Sunny."), EOS_ID]
    history = [
        {"role": "user", "content": "Weather?"},
        *[item.model_dump(exclude_none=True) for item in reply.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    again = await client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER])
    assert again.output_text == "Sunny."
    sent = chat_sent(cluster)
    assert sent[2][0] == "assistant" and sent[2][1].startswith("Sure.")
    assert '"city": "Oslo"' in sent[2][1]  # the call, written after the assistant's text
    assert sent[3][0] == "user" and "sunny" in sent[3][1]  # the result, as a tool response


async def test_required_tool_choice_constrains_the_output(http, cluster):
    cluster.script.output_ids = [*char_ids(f"[{CALL}]"), EOS_ID]
    named = {"type": "function", "name": "get_weather"}
    for choice in ("required", named):
        body = {**BODY, "tools": [WEATHER], "tool_choice": choice}
        reply = (await http.post(PATH, json=body)).json()
        assert [item["type"] for item in reply["output"]] == ["function_call"], reply
        assert reply["tool_choice"] == choice
    for reserve in cluster.decode.reserved.values():
        assert reserve.sampling_params.grammar.is_strict


async def stream_events(client, **fields) -> list:
    stream = await client.responses.create(model=MODEL_NAME, stream=True, **fields)
    return [event async for event in stream]


async def test_stream_events_build_the_same_response(client, cluster):
    cluster.script.chunk_size = 1
    whole = await client.responses.create(model=MODEL_NAME, input="Say hello.")
    events = await stream_events(client, input="Say hello.")
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= len(EXPECTED) // 2
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert joined == whole.output_text == EXPECTED
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == EXPECTED and final.usage.total_tokens == whole.usage.total_tokens
    assert len({e.response.id for e in (events[0], events[1], events[-1])}) == 1


async def test_stream_with_a_function_call(client, cluster):
    tool_call_output(cluster)
    cluster.script.chunk_size = 3
    events = await stream_events(client, input="Weather?", tools=[WEATHER])
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(arguments) == done.arguments == '{"city": "Oslo"}'
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == "Sure."
    assert final.output[1].id == done.item_id and final.output[1].arguments == done.arguments


async def test_raw_stream_names_each_event_and_sends_no_done(http):
    response = await http.post(PATH, json={**BODY, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [frame.split("\n") for frame in response.text.split("\n\n") if frame.strip()]
    for event_line, data_line in frames:
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
    assert "[DONE]" not in response.text


async def test_max_output_tokens_makes_it_incomplete(client, cluster):
    reply = await client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == EXPECTED[:4] and reply.output[0].status == "incomplete"
    assert reply.usage.output_tokens == 4 and reply.max_output_tokens == 4
    events = await stream_events(client, input="Hi", max_output_tokens=4)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


async def test_output_logprobs_are_asked_of_decode(http, cluster):
    body = {**BODY, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = await http.post(PATH, json=body)
    assert response.status_code == 200, response.text
    [reserve] = cluster.decode.reserved.values()
    params = reserve.sampling_params
    assert (params.return_logprobs, params.num_top_logprobs) == (True, 2)
    assert response.json()["top_logprobs"] == 2


async def test_error_mid_stream_is_an_error_event(client, cluster):
    cluster.script.chunk_size, cluster.script.decode_fail_after = 1, 3
    stream = await client.responses.create(model=MODEL_NAME, input="Hi", stream=True)
    received = []
    with pytest.raises(openai.APIError) as info:
        async for event in stream:
            received.append(event.type)
    assert received[:2] == ["response.created", "response.in_progress"]
    assert "response.completed" not in received
    assert info.value.body["type"] == "service_unavailable"


async def test_refused_store_is_a_bad_request_for_the_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL_NAME, input="Hi", store=True)
    assert info.value.param == "store" and "not stored" in info.value.message


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [{**WEATHER, "cache": True}]}, "tools[0].cache"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [WEATHER], "include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name"),
        ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"model": "other"}, "model"),
        ({"seed": 1}, "seed"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{**IMAGE, "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "user", "content": [{**IMAGE, "detail": "low"}]}]},
            "input[0].content[0].detail",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1]"},
                ]
            },
            "input[0].arguments",
        ),
    ],
)
async def test_refused_or_bad_fields_are_a_400_naming_them(http, cluster, fields, param):
    message = await assert_400(http, PATH, {**BODY, **fields}, param)
    assert "messages" not in message and "max_tokens" not in message, message
    assert "response_format" not in message, message
    assert not cluster.decode.reserved


async def test_a_chat_path_error_names_the_responses_field(http):
    body = json.dumps({**BODY, "instructions": "\ud800"}).encode()  # a lone surrogate
    response = await http.post(PATH, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "instructions"
    assert error["message"].startswith("instructions is not valid Unicode"), error
