"""The chat template and detokenization fields through gRPC ``Router.Generate`` and the typed
client: ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and
``skip_special_tokens``, checked as on HTTP (``tests/router/test_chat_template_fields.py``)."""

from __future__ import annotations

import json

import grpc
import pytest

from services.common.grpc_errors import ERROR_PARAM_KEY
from services.common.pb.stageserve.v1 import router_pb2, router_pb2_grpc
from stageserve.client import AsyncClient, InvalidRequestError, Message, calls
from tests.router.conftest import BOUND_S
from tests.router.fakes import EOS_ID, TEXT, char_ids

CONTINUED = [Message("user", "Count to three."), Message("assistant", "One, two,")]
IM_END = TEXT.encode("<|im_end|>")[0]


def address(router) -> str:
    return f"127.0.0.1:{router.grpc_port}"


async def test_template_fields_reach_the_tokenizer(router, cluster):
    kwargs = {"enable_thinking": False, "n": [1, 2]}
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        await client.generate(
            messages=CONTINUED,
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template_kwargs=kwargs,
        )
        await client.generate(messages=CONTINUED)
    continued, plain = cluster.tokenizer.servicer.requests
    assert continued.continue_final_message and not continued.add_generation_prompt
    assert json.loads(continued.chat_template_kwargs) == kwargs
    assert plain.add_generation_prompt and not plain.continue_final_message
    assert plain.chat_template_kwargs == ""


async def test_skip_special_tokens_false_keeps_their_text(router, cluster):
    cluster.script.output_ids = [*char_ids("a"), IM_END, *char_ids("b"), EOS_ID]
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        kept = await client.generate("Once", skip_special_tokens=False)
        skipped = await client.generate(messages=CONTINUED, skip_special_tokens=True)
        default = await client.generate("Once")
    assert kept.text == "a<|im_end|>b"
    assert skipped.text == default.text == "ab"
    assert kept.token_ids == default.token_ids  # the ids hold them either way


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {f"k{i}": i for i in range(33)}}, "chat_template_kwargs"),
    ],
)
async def test_bad_template_fields_are_invalid_argument_naming_them(
    router, cluster, options, param
):
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(messages=CONTINUED, **options)
    assert info.value.param == param
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False},
        {"add_generation_prompt": True},  # set at all: no template renders a prompt
        {"continue_final_message": True, "add_generation_prompt": False},
        {"chat_template_kwargs": {"tone": "dry"}},
    ],
)
async def test_template_fields_need_a_chat(router, cluster, options):
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate("Once", **options)
    assert info.value.param in options
    assert not cluster.tokenizer.servicer.requests


async def test_continuing_a_user_message_is_refused(router, cluster):
    async with AsyncClient(address(router), timeout_s=BOUND_S) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(
                messages=CONTINUED[:1], add_generation_prompt=False, continue_final_message=True
            )
    assert info.value.param == "continue_final_message" and "user message" in str(info.value)


@pytest.mark.parametrize("text", ["[1]", "{not json", '{"a": NaN}'])
async def test_kwargs_text_that_is_no_json_object_is_refused(router, cluster, text):
    request = router_pb2.GenerateRequest(chat_template_kwargs=text)
    request.chat.messages.add(role="user").content.add(text="hi")
    async with grpc.aio.insecure_channel(address(router)) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=BOUND_S)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    trailing = dict(info.value.trailing_metadata() or ())
    assert trailing[ERROR_PARAM_KEY] == "chat_template_kwargs"
    assert not cluster.tokenizer.servicer.requests


def test_the_client_refuses_kwargs_that_are_no_json():
    with pytest.raises(InvalidRequestError) as info:
        calls.call_spec(messages=CONTINUED, chat_template_kwargs={"x": object()})
    assert info.value.param == "chat_template_kwargs"
    spec = calls.call_spec(messages=CONTINUED, chat_template_kwargs={"x": [1]})
    assert json.loads(spec.request.chat_template_kwargs) == {"x": [1]}
    assert not spec.request.HasField("add_generation_prompt")
    assert not spec.request.HasField("skip_special_tokens")
