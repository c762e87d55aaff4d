"""What ``Router.Generate`` refuses is INVALID_ARGUMENT naming the field by its gRPC path, before
any worker is called: bad choices, tools, tool choices, grammars and tool turns in the history
(the same fake workers and stub as ``test_grpc_features.py``)."""

from __future__ import annotations

import grpc
import pytest

from services.common.grpc_errors import ERROR_PARAM_KEY
from services.common.pb.stageserve.v1 import common_pb2, router_pb2
from services.router.tools import MAX_TOOLS
from tests.conftest import image_bytes
from tests.router.test_grpc_features import (
    TIME_PB,
    WEATHER_PB,
    generate,
    history_pb,
    stub,
    user_chat,
)

__all__ = ["stub"]  # the fixture, imported for the tests here


def _tool_message(**fields) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        **{"role": "tool", "content": [common_pb2.ContentPart(text="rain")], **fields}
    )


def _history_chat(history: list[common_pb2.ChatMessage]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=history)


def _user_with(**fields) -> common_pb2.ChatMessages:
    user = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="x")])
    user.MergeFrom(common_pb2.ChatMessage(**fields))
    return common_pb2.ChatMessages(messages=[user])


_BAD_CALL = common_pb2.ToolCall(id="c1", name="get_weather", arguments="[1]")
_IMAGE_RESULT = [common_pb2.ContentPart(image=common_pb2.ImageInput(data=image_bytes(8, 8)))]


CHAT_TOOLS = {"chat": user_chat("Weather?"), "tools": [WEATHER_PB]}
REQUIRED = router_pb2.ToolChoice(mode="required")
JSON_OBJECT = common_pb2.SamplingParams(grammar=common_pb2.Grammar(kind="json_object"))
REFUSED = [
    ({"prompt": "x", "num_choices": 9}, "num_choices"),  # the default --max-n is 8
    ({"prompt": "x", "tools": [WEATHER_PB]}, "tools"),
    ({**CHAT_TOOLS, "tools": [WEATHER_PB, WEATHER_PB]}, "tools[1].name"),
    ({**CHAT_TOOLS, "tools": [router_pb2.Tool(name="bad name")]}, "tools[0].name"),
    ({**CHAT_TOOLS, "tools": [TIME_PB] * (MAX_TOOLS + 1)}, "tools"),
    ({**CHAT_TOOLS, "tools": [router_pb2.Tool(name="f", parameters="[1]")]}, "tools[0].parameters"),
    ({**CHAT_TOOLS, "tools": [router_pb2.Tool(name="f", parameters="{x")]}, "tools[0].parameters"),
    ({**CHAT_TOOLS, "tool_choice": router_pb2.ToolChoice(mode="always")}, "tool_choice.mode"),
    (
        {**CHAT_TOOLS, "tool_choice": router_pb2.ToolChoice(function_name="get_time")},
        "tool_choice.function_name",
    ),
    ({**CHAT_TOOLS, "tool_choice": router_pb2.ToolChoice()}, "tool_choice"),
    ({"chat": user_chat("x"), "tool_choice": REQUIRED}, "tool_choice.mode"),
    ({"chat": user_chat("x"), "parallel_tool_calls": True}, "parallel_tool_calls"),
    (
        {**CHAT_TOOLS, "tool_choice": REQUIRED, "sampling_params": JSON_OBJECT},
        "sampling_params.grammar",
    ),
    (
        {
            **CHAT_TOOLS,
            "tools": [router_pb2.Tool(name="f", parameters='{"type": "no-such"}')],
            "tool_choice": REQUIRED,
        },
        "tools",
    ),
    ({"chat": user_chat("x", _tool_message())}, "chat.messages[1].tool_call_id"),
    ({"chat": _history_chat(history_pb(tool_call_id="c9"))}, "chat.messages[2].tool_call_id"),
    ({"chat": user_chat("x", _tool_message(tool_call_id="c1"))}, "chat.messages[1].tool_call_id"),
    ({"chat": _user_with(tool_call_id="c1")}, "chat.messages[0].tool_call_id"),
    ({"chat": _user_with(tool_calls=[_BAD_CALL])}, "chat.messages[0].tool_calls"),
    ({"chat": user_chat("x", common_pb2.ChatMessage(role="robot"))}, "chat.messages[1].role"),
    (
        {"chat": user_chat("x", common_pb2.ChatMessage(role="assistant", tool_calls=[_BAD_CALL]))},
        "chat.messages[1].tool_calls[0].arguments",
    ),
    (
        {
            "chat": _history_chat(
                [*history_pb()[:2], _tool_message(tool_call_id="c1", content=_IMAGE_RESULT)]
            )
        },
        "chat.messages[2].content",
    ),
    (
        {
            "chat": user_chat("x"),
            "sampling_params": common_pb2.SamplingParams(num_prompt_logprobs=0),
        },
        "num_prompt_logprobs",
    ),
    (
        {
            "prompt_embeds": b"\0",
            "sampling_params": common_pb2.SamplingParams(num_prompt_logprobs=0),
        },
        "num_prompt_logprobs",
    ),
    (
        {"prompt": "x", "sampling_params": common_pb2.SamplingParams(num_prompt_logprobs=21)},
        "num_prompt_logprobs",
    ),
    (
        {"prompt": "x", "sampling_params": common_pb2.SamplingParams(max_new_tokens=0)},
        "max_new_tokens",
    ),
    (
        {
            "prompt": "x",
            "sampling_params": common_pb2.SamplingParams(
                max_new_tokens=0, num_prompt_logprobs=0, min_tokens=1
            ),
        },
        "min_tokens",
    ),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
async def test_what_grpc_refuses_is_invalid_argument_naming_the_field(stub, cluster, fields, param):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())[ERROR_PARAM_KEY] == param
    assert not cluster.tokenizer.servicer.requests and not cluster.decode.reserved
