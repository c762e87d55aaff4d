"""``Router.Generate`` against the HTTP API, over the same fake workers: ``num_choices`` as
``n``, logprobs, prompt logprobs (echo), a grammar, tools and stop strings give the same result
through both for the same request (what gRPC refuses: ``test_grpc_refusals.py``).

Fake workers (``fakes.py``): the tokenizer records each chat it tokenizes, prefill answers the
logprobs asked for, decode none; a grammar compiles for real in the router's compiler child.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest

from services.common.client import create_channel
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.wire import sampling_params_from_proto
from tests.router.conftest import BOUND_S, MODEL_NAME
from tests.router.fakes import EOS_ID, char_ids
from tests.router.http_helpers import CHAT_PATH, COMPLETIONS_PATH, EXPECTED

PROMPT = "Once upon"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": PARAMETERS,
    },
}
WEATHER_PB = router_pb2.Tool(
    name="get_weather", description="The weather in a city.", parameters=json.dumps(PARAMETERS)
)
TIME_PB = router_pb2.Tool(name="get_time")
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.fixture
async def stub(router) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    channel = create_channel(f"127.0.0.1:{router.grpc_port}")
    yield router_pb2_grpc.RouterStub(channel)
    await channel.close()


def user_chat(text: str, *more: common_pb2.ChatMessage) -> common_pb2.ChatMessages:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=text)])
    return common_pb2.ChatMessages(messages=[message, *more])


async def generate(stub, **fields) -> list[router_pb2.GenerateResponse]:
    request = router_pb2.GenerateRequest(**fields)
    return [r async for r in stub.Generate(request, timeout=BOUND_S)]


def by_choice(responses) -> dict[int, list[router_pb2.GenerateResponse]]:
    grouped = defaultdict(list)
    for response in responses:
        grouped[response.choice_index].append(response)
    return dict(grouped)


def reserved_seeds(cluster) -> list[int | None]:
    return sorted(
        sampling_params_from_proto(r.sampling_params).seed for r in cluster.decode.reserved.values()
    )


def calls_of(responses) -> list[tuple[str, str, str]]:
    """A choice's calls (id, name, arguments) from its tool-call pieces."""
    calls: list[list[str]] = []
    for piece in (p for r in responses for p in r.tool_calls):
        if piece.index == len(calls):
            assert piece.id and piece.name  # a call's first piece names it
            calls.append([piece.id, piece.name, ""])
        calls[piece.index][2] += piece.arguments
    return [tuple(call) for call in calls]


async def test_num_choices_runs_as_http_n(stub, http, cluster):
    params = common_pb2.SamplingParams(seed=7, max_new_tokens=100)
    responses = await generate(stub, prompt=PROMPT, num_choices=3, sampling_params=params)
    grpc_seeds = reserved_seeds(cluster)
    choices = by_choice(responses)
    assert sorted(choices) == [0, 1, 2]
    for messages in choices.values():
        assert "".join(m.text_delta for m in messages) == EXPECTED
        assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert messages[-1].usage.num_completion_tokens == len(cluster.script.output_ids)
    cluster.decode.reserved.clear()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": 3, "seed": 7, "max_tokens": 100}
    http_choices = (await http.post(COMPLETIONS_PATH, json=body)).json()["choices"]
    assert [c["text"] for c in http_choices] == [EXPECTED] * 3
    assert grpc_seeds == reserved_seeds(cluster) == [7, 8, 9]


async def test_logprobs_are_http_s(stub, http, cluster):
    params = common_pb2.SamplingParams(
        temperature=0, max_new_tokens=100, return_logprobs=True, num_top_logprobs=2
    )
    responses = await generate(stub, prompt=PROMPT, sampling_params=params)
    logprobs = [lp for r in responses for lp in r.logprobs]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 100}
    choice = (await http.post(COMPLETIONS_PATH, json={**body, "logprobs": 2})).json()["choices"][0]
    assert len(logprobs) == 1  # the fake prefill answers the first token's, decode none
    assert [lp.logprob for lp in logprobs] == choice["logprobs"]["token_logprobs"]
    assert [list(lp.top_logprobs) for lp in logprobs] == [
        list(top.values()) for top in choice["logprobs"]["top_logprobs"]
    ]
    assert logprobs[0].token_id == cluster.script.output_ids[0]


async def test_prompt_logprobs_are_http_s_and_max_new_tokens_0_is_the_prompt_alone(stub, http):
    params = common_pb2.SamplingParams(max_new_tokens=0, num_prompt_logprobs=1)
    [response] = await generate(stub, prompt=PROMPT, sampling_params=params)
    assert not response.token_ids and not response.text_delta
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert response.usage.num_completion_tokens == 0
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    choice = (await http.post(COMPLETIONS_PATH, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [
        None,
        *(lp.logprob for lp in response.prompt_logprobs),
    ]
    assert len(response.prompt_token_ids) == len(response.prompt_logprobs) + 1
    assert all(len(lp.top_token_ids) == 1 for lp in response.prompt_logprobs)


async def test_prompt_logprobs_come_first_in_each_choice(stub, cluster):
    params = common_pb2.SamplingParams(max_new_tokens=100, num_prompt_logprobs=2)
    responses = await generate(stub, prompt=PROMPT, num_choices=2, sampling_params=params)
    [reserve, _] = cluster.decode.reserved.values()
    for messages in by_choice(responses).values():
        assert list(messages[0].prompt_token_ids) == list(reserve.prompt_token_ids)
        assert all(not m.prompt_token_ids for m in messages[1:])
        assert "".join(m.text_delta for m in messages) == EXPECTED


async def test_a_json_schema_reaches_the_workers_as_http_s_grammar(stub, http, cluster):
    spec = json.dumps(SCHEMA, separators=(",", ":"))
    grammar = common_pb2.Grammar(kind="json_schema", spec=spec, is_strict=True)
    params = common_pb2.SamplingParams(max_new_tokens=4, grammar=grammar)
    await generate(stub, prompt=PROMPT, sampling_params=params)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    body["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
    }
    assert (await http.post(COMPLETIONS_PATH, json=body)).status_code == 200
    [grpc_reserve, http_reserve] = cluster.decode.reserved.values()
    [grpc_prefill, http_prefill] = cluster.prefill.requests
    assert grpc_reserve.sampling_params.grammar == grammar
    for sent in (http_reserve, grpc_prefill, http_prefill):
        assert sent.sampling_params.grammar == grammar


async def test_tool_calls_are_parsed_as_http_parses_them(stub, http, cluster):
    cluster.script.output_ids = [*char_ids(f"Sure.\n<tool_call>\n{CALL}\n</tool_call>"), EOS_ID]
    cluster.script.chunk_size = 3  # the tags arrive split across messages
    responses = await generate(
        stub,
        chat=user_chat("Weather?"),
        tools=[WEATHER_PB, TIME_PB],
        sampling_params=common_pb2.SamplingParams(max_new_tokens=128),
    )
    time_tool = {"type": "function", "function": {"name": "get_time"}}
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 128,
        "tools": [WEATHER, time_tool],
    }
    message = (await http.post(CHAT_PATH, json=body)).json()["choices"][0]["message"]
    [grpc_chat, http_chat] = [r.chat for r in cluster.tokenizer.servicer.requests]
    assert grpc_chat == http_chat  # the same tools listed the same way
    assert "".join(r.text_delta for r in responses) == message["content"] == "Sure."
    [(call_id, name, arguments)] = calls_of(responses)
    [http_call] = message["tool_calls"]
    assert call_id.startswith("call_")
    assert {"name": name, "arguments": arguments} == http_call["function"]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert [t for r in responses for t in r.token_ids] == cluster.script.output_ids


def history_pb(*, tool_call_id: str = "c1") -> list[common_pb2.ChatMessage]:
    """A user turn, an assistant turn with text and two calls, and the calls' results."""
    calls = [
        common_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}'),
        common_pb2.ToolCall(id="c2", name="get_time", arguments="{}"),
    ]
    text = [common_pb2.ContentPart(text="Checking.")]
    return [
        common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Weather?")]),
        common_pb2.ChatMessage(role="assistant", content=text, tool_calls=calls),
        common_pb2.ChatMessage(
            role="tool",
            content=[common_pb2.ContentPart(text="rain")],
            tool_call_id=tool_call_id,
        ),
        common_pb2.ChatMessage(
            role="tool", content=[common_pb2.ContentPart(text="noon")], tool_call_id="c2"
        ),
    ]


async def test_tool_turns_in_history_render_as_http_s(stub, http, cluster):
    sampling = common_pb2.SamplingParams(max_new_tokens=8)
    history = common_pb2.ChatMessages(messages=history_pb())
    await generate(stub, chat=history, tools=[WEATHER_PB, TIME_PB], sampling_params=sampling)
    time_tool = {"type": "function", "function": {"name": "get_time"}}
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
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
            },
            {"role": "tool", "content": "rain", "tool_call_id": "c1"},
            {"role": "tool", "content": "noon", "tool_call_id": "c2"},
        ],
        "max_tokens": 8,
        "tools": [WEATHER, time_tool],
    }
    assert (await http.post(CHAT_PATH, json=body)).status_code == 200
    [grpc_chat, http_chat] = [r.chat for r in cluster.tokenizer.servicer.requests]
    assert grpc_chat == http_chat
    assert [m.role for m in grpc_chat.messages] == ["system", "user", "assistant", "user"]
    assert "<tool_call>" in grpc_chat.messages[2].content[-1].text
    assert "<tool_response>\nnoon" in grpc_chat.messages[3].content[-1].text
    assert not any(m.tool_calls or m.tool_call_id for m in grpc_chat.messages)  # written in
    [grpc_prefill, http_prefill] = cluster.prefill.requests
    assert grpc_prefill.token_ids == http_prefill.token_ids


async def test_tool_choice_required_constrains_and_parses_as_http(stub, http, cluster):
    cluster.script.output_ids = [*char_ids(f"[{CALL}]"), EOS_ID]
    responses = await generate(
        stub,
        chat=user_chat("Weather?"),
        tools=[WEATHER_PB],
        tool_choice=router_pb2.ToolChoice(mode="required"),
        parallel_tool_calls=False,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=128),
    )
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 128,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    choice = (await http.post(CHAT_PATH, json=body)).json()["choices"][0]
    [grpc_reserve, http_reserve] = cluster.decode.reserved.values()
    assert grpc_reserve.sampling_params.grammar == http_reserve.sampling_params.grammar
    assert grpc_reserve.sampling_params.grammar.kind == "json_schema"
    [(_, name, arguments)] = calls_of(responses)
    [http_call] = choice["message"]["tool_calls"]
    assert {"name": name, "arguments": arguments} == http_call["function"]
    assert "".join(r.text_delta for r in responses) == "" and choice["message"]["content"] is None


async def test_tool_choice_none_leaves_the_text_alone(stub, cluster):
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    cluster.script.output_ids = [*char_ids(text), EOS_ID]
    responses = await generate(
        stub,
        chat=user_chat("Weather?"),
        tools=[WEATHER_PB],
        tool_choice=router_pb2.ToolChoice(mode="none"),
        sampling_params=common_pb2.SamplingParams(max_new_tokens=128),
    )
    assert "".join(r.text_delta for r in responses) == text
    assert not calls_of(responses)


@pytest.mark.parametrize("stop", [["there"], ["o t", "zzz"]])
async def test_stop_strings_end_the_text_as_on_http(stub, http, stop):
    responses = await generate(
        stub,
        prompt=PROMPT,
        stop=stop,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=100),
    )
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 100, "stop": stop}
    choice = (await http.post(COMPLETIONS_PATH, json=body)).json()["choices"][0]
    assert "".join(r.text_delta for r in responses) == choice["text"]
    assert choice["text"] == EXPECTED[: EXPECTED.index(stop[0])]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert choice["finish_reason"] == "stop"
