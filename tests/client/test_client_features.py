"""``stageserve.client``'s OpenAI features against a router serving fake workers: choices,
a grammar, tools and prompt logprobs, as ``Sampling`` and call options carry them and as
``Chunk`` and ``Completion`` return them."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.pb.stageserve.v1 import common_pb2
from services.common.wire import sampling_params_from_proto
from stageserve.client import (
    AsyncClient,
    Client,
    FinishReason,
    Grammar,
    GrammarKind,
    InvalidRequestError,
    Message,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
    calls,
)
from tests.router.conftest import BOUND_S
from tests.router.fakes import EOS_ID, char_ids

EXPECTED = "Hello there, world!"
WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def address(router) -> str:
    return f"127.0.0.1:{router.grpc_port}"


async def test_generate_choices_returns_each_choice_in_order(router, cluster):
    sampling = Sampling(seed=3, max_new_tokens=100)
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        done = await client.generate_choices("Once", sampling=sampling, num_choices=3)
        with pytest.raises(InvalidRequestError) as info:
            await client.generate("Once", num_choices=2)
    assert [c.choice_index for c in done] == [0, 1, 2]
    assert [c.text for c in done] == [EXPECTED] * 3
    assert all(c.finish_reason is FinishReason.STOP for c in done)
    seeds = [
        sampling_params_from_proto(r.sampling_params).seed for r in cluster.decode.reserved.values()
    ]
    assert sorted(seeds) == [3, 4, 5]
    assert info.value.param == "num_choices"


async def test_a_grammar_reaches_the_workers(router, cluster):
    spec = json.dumps({"type": "object"})
    sampling = Sampling(max_new_tokens=4, grammar=Grammar(GrammarKind.JSON_SCHEMA, spec))
    with Client(address(router), timeout_s=BOUND_S) as client:
        await asyncio.to_thread(client.generate, "Once", sampling=sampling)
    [reserve] = cluster.decode.reserved.values()
    assert reserve.sampling_params.grammar == common_pb2.Grammar(kind="json_schema", spec=spec)


async def test_tool_calls_arrive_as_pieces_and_join_into_calls(router, cluster):
    cluster.script.output_ids = [*char_ids(f"Sure.\n<tool_call>\n{CALL}\n</tool_call>"), EOS_ID]
    chat = [Message("user", "Weather?")]
    options = {"messages": chat, "tools": [WEATHER], "sampling": Sampling(max_new_tokens=128)}
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        async with client.stream(**options) as stream:
            chunks = [chunk async for chunk in stream]
        done = await client.generate(**options, tool_choice="auto")
    pieces = [piece for chunk in chunks for piece in chunk.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id.startswith("call_")
    assert "".join(p.arguments for p in pieces) == '{"city": "Oslo"}'
    assert done.text == "Sure."
    [call] = done.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    system = cluster.tokenizer.servicer.requests[-1].chat.messages[0]
    assert '"name": "get_weather"' in system.content[1].text


async def test_a_completion_s_calls_and_their_results_go_back_as_history(router, cluster):
    cluster.script.output_ids = [*char_ids(f"<tool_call>\n{CALL}\n</tool_call>"), EOS_ID]
    chat = [Message("user", "Weather?")]
    options = {"tools": [WEATHER], "sampling": Sampling(max_new_tokens=128)}
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        done = await client.generate(messages=chat, **options)
        [call] = done.tool_calls
        history = [
            *chat,
            Message("assistant", tool_calls=done.tool_calls),
            Message("tool", "rain", tool_call_id=call.id),
        ]
        await client.generate(messages=history, **options)
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(messages=[*history[:2], Message("tool", "rain")], **options)
    rendered = cluster.tokenizer.servicer.requests[-1].chat.messages
    assert [m.role for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[2].content[-1].text == f"<tool_call>\n{CALL}\n</tool_call>"
    assert rendered[3].content[-1].text == "<tool_response>\nrain\n</tool_response>"
    assert info.value.param == "chat.messages[2].tool_call_id"


async def test_prompt_logprobs_alone(router):
    sampling = Sampling(max_new_tokens=0, num_prompt_logprobs=1)
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        done = await client.generate("Once upon", sampling=sampling)
    assert done.token_ids == () and done.finish_reason is FinishReason.LENGTH
    assert len(done.prompt_token_ids) == len(done.prompt_logprobs) + 1 > 1


def test_tool_options_are_encoded_as_the_proto_has_them():
    spec = calls.call_spec(
        messages=[Message("user", "x")],
        tools=[WEATHER, Tool("get_time")],
        tool_choice=ToolChoice(function_name="get_time"),
        num_choices=2,
    )
    request = spec.request
    assert [t.name for t in request.tools] == ["get_weather", "get_time"]
    assert json.loads(request.tools[0].parameters) == WEATHER.parameters
    assert request.tools[1].parameters == "" and request.tools[1].description == ""
    assert request.tool_choice.function_name == "get_time" and request.num_choices == 2
    assert not request.HasField("parallel_tool_calls")
    required = calls.call_spec("x", tool_choice="required", parallel_tool_calls=False).request
    assert required.tool_choice.mode == "required" and required.parallel_tool_calls is False
    turns = [
        Message("assistant", "Checking.", tool_calls=[ToolCall("c1", "get_time", "{}")]),
        Message("tool", "noon", tool_call_id="c1"),
    ]
    chat = calls.call_spec(messages=turns).request.chat
    assert chat.messages[0].tool_calls == [
        common_pb2.ToolCall(id="c1", name="get_time", arguments="{}")
    ]
    assert [m.tool_call_id for m in chat.messages] == ["", "c1"]
    assert [p.text for p in chat.messages[1].content] == ["noon"]
    with pytest.raises(InvalidRequestError):
        calls.call_spec(messages=[Message("assistant", tool_calls=[{"id": "c1"}])])
    with pytest.raises(InvalidRequestError):
        ToolChoice()
    with pytest.raises(InvalidRequestError):
        ToolChoice(mode="auto", function_name="f")
