"""gRPC ``Router.Generate``: the same pipeline as HTTP, streamed as GenerateResponse messages."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.client import create_channel
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.conftest import image_bytes, sdk_provider
from tests.router.conftest import BOUND_S, MODEL_NAME, wait_until
from tests.router.fakes import EOS_ID, char_ids
from tests.router.hostile import png_bomb

EXPECTED = "Hello there, world!"


@pytest.fixture
async def stub(router) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    channel = create_channel(f"127.0.0.1:{router.grpc_port}")
    yield router_pb2_grpc.RouterStub(channel)
    await channel.close()


def chat(text: str, image: bytes | None = None) -> common_pb2.ChatMessages:
    message = common_pb2.ChatMessage(role="user")
    if image is not None:
        message.content.add(image=common_pb2.ImageInput(data=image))
    message.content.add(text=text)
    return common_pb2.ChatMessages(messages=[message])


async def test_generate_streams_text_and_usage(stub, cluster):
    request = router_pb2.GenerateRequest(
        request_id="req-1",
        chat=chat("hello", image_bytes(30, 30)),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=100),
    )
    responses = [r async for r in stub.Generate(request, timeout=BOUND_S)]
    assert all(r.request_id == "req-1" for r in responses)
    assert "".join(r.text_delta for r in responses) == EXPECTED
    assert [t for r in responses for t in r.token_ids] == cluster.script.output_ids
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    usage = responses[-1].usage
    assert usage.num_completion_tokens == len(cluster.script.output_ids)
    [reserve] = cluster.decode.reserved.values()
    assert usage.num_prompt_tokens == len(reserve.prompt_token_ids)
    assert reserve.request_id.startswith("gen-")  # the router's own id, not the client's label
    assert len(cluster.prefill.requests[0].images) == 1


async def test_generate_prompt_with_stop_string_and_default_max_tokens(stub, cluster):
    request = router_pb2.GenerateRequest(prompt="Once", stop=["there"])
    responses = [r async for r in stub.Generate(request, timeout=BOUND_S)]
    assert "".join(r.text_delta for r in responses) == "Hello "
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert responses[0].request_id.startswith("gen-")
    request_id = responses[0].request_id
    assert cluster.decode.max_new_tokens(request_id) == 16  # the proto's documented default


@pytest.mark.parametrize(
    ("request_fields", "code"),
    [
        ({"model": "other", "prompt": "x"}, grpc.StatusCode.NOT_FOUND),
        ({}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"prompt": "x", "sampling_params": common_pb2.SamplingParams(temperature=-1)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {"prompt": "x", "sampling_params": common_pb2.SamplingParams(temperature=math.inf)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {
                "prompt": "x",
                "sampling_params": common_pb2.SamplingParams(repetition_penalty=math.inf),
            },
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {"prompt": "x", "sampling_params": common_pb2.SamplingParams(top_p=math.nan)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {"prompt": "x", "sampling_params": common_pb2.SamplingParams(top_k=2**31)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"chat": common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="wizard")])},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"chat": chat("x", b"not an image")}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"chat": chat("x", png_bomb())}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "7" * 5000}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_generate_bad_requests(stub, cluster, request_fields, code):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(router_pb2.GenerateRequest(**request_fields), timeout=BOUND_S):
            pass
    assert info.value.code() == code
    assert not cluster.decode.reserved
    ok = [
        r
        async for r in stub.Generate(
            router_pb2.GenerateRequest(model=MODEL_NAME, prompt="a"), timeout=BOUND_S
        )
    ]
    assert ok[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_generate_timeout_ms_is_deadline_exceeded_and_aborts(stub, cluster):
    cluster.script.chunk_delay_s = 60
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(
            router_pb2.GenerateRequest(prompt="a", timeout_ms=300), timeout=BOUND_S
        ):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))


async def test_generate_cancelled_by_the_client_aborts(stub, cluster):
    cluster.script.output_ids = [*char_ids("y" * 300), EOS_ID]
    cluster.script.chunk_size, cluster.script.chunk_delay_s = 1, 0.02
    request = router_pb2.GenerateRequest(
        prompt="a", sampling_params=common_pb2.SamplingParams(max_new_tokens=300)
    )
    call = stub.Generate(request, timeout=BOUND_S)
    for _ in range(3):
        await call.read()
    call.cancel()
    await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))


async def test_generate_without_workers_is_unavailable(stub, cluster, router):
    cluster.tokenizer.health.set_serving(False)
    await router.registry.poll_once()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="a"), timeout=BOUND_S):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("min_p", math.nan),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", -3.0),
        ("top_k", 2**31),
    ],
)
async def test_http_and_grpc_refuse_sampling_values_alike(stub, http, field, value):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        params = common_pb2.SamplingParams(**{field: value})
        async for _ in stub.Generate(
            router_pb2.GenerateRequest(prompt="x", sampling_params=params), timeout=BOUND_S
        ):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", field: value}).encode()
    response = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["message"] == info.value.details()


async def test_one_client_request_id_on_two_concurrent_calls_makes_two_requests(stub, cluster):
    cluster.script.chunk_size, cluster.script.chunk_delay_s = 1, 0.01
    request = router_pb2.GenerateRequest(
        request_id="dup-1",
        prompt="a",
        sampling_params=common_pb2.SamplingParams(max_new_tokens=100),
    )

    async def call() -> list[router_pb2.GenerateResponse]:
        return [r async for r in stub.Generate(request, timeout=BOUND_S)]

    results = await asyncio.gather(call(), call())
    for responses in results:
        assert all(r.request_id == "dup-1" for r in responses)
        assert "".join(r.text_delta for r in responses) == EXPECTED
    internal_ids = list(cluster.decode.reserved)
    assert len(internal_ids) == 2 and "dup-1" not in internal_ids


async def test_a_cancelled_call_cannot_abort_another_call_with_its_request_id(stub, cluster):
    cluster.script.output_ids = [*char_ids("z" * 60), EOS_ID]
    cluster.script.chunk_size, cluster.script.chunk_delay_s = 1, 0.02
    request = router_pb2.GenerateRequest(
        request_id="shared",
        prompt="a",
        sampling_params=common_pb2.SamplingParams(max_new_tokens=100),
    )
    survivor = asyncio.ensure_future(_collect(stub.Generate(request, timeout=BOUND_S)))
    await wait_until(lambda: len(cluster.decode.reserved) == 1)
    victim = stub.Generate(request, timeout=BOUND_S)
    await victim.read()
    victim.cancel()  # its clean-up aborts its own request on decode
    await wait_until(lambda: len(cluster.aborted()) == 1)
    responses = await survivor
    assert "".join(r.text_delta for r in responses) == "z" * 60
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    [survivor_id, victim_id] = list(cluster.decode.reserved)
    assert cluster.aborted() == [victim_id]


async def _collect(call) -> list[router_pb2.GenerateResponse]:
    return [r async for r in call]


async def test_overlong_client_request_id_is_invalid(stub, cluster):
    request = router_pb2.GenerateRequest(request_id="x" * 257, prompt="a")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub.Generate(request, timeout=BOUND_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not cluster.decode.reserved


async def test_client_request_id_is_a_span_attribute_of_the_request(stub, cluster):
    exporter = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(exporter))
    request = router_pb2.GenerateRequest(request_id="client-label-7", prompt="a")
    await _collect(stub.Generate(request, timeout=BOUND_S))
    exporter.shutdown()
    spans = exporter.get_finished_spans()
    (rpc,) = [s for s in spans if s.attributes.get("client_request_id") == "client-label-7"]
    [internal_id] = list(cluster.decode.reserved)
    assert rpc.attributes["request_id"] == internal_id
    (inner,) = [
        s for s in spans if s.name == "router.request" and s.attributes["request_id"] == internal_id
    ]
    assert inner.parent.span_id == rpc.context.span_id


UNKNOWN_FIELD = bytes([0xF8, 0x06, 0x01])  # field 111, varint 1: no stageserve message defines it


def with_unknown_field(message):
    out = type(message)()
    out.ParseFromString(message.SerializeToString() + UNKNOWN_FIELD)
    return out


def _unknown_in(where: str) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        chat=chat("hi"), sampling_params=common_pb2.SamplingParams(temperature=0)
    )
    if where == "request":
        return with_unknown_field(request)
    if where == "sampling_params":
        request.sampling_params.CopyFrom(with_unknown_field(request.sampling_params))
    else:
        request.chat.messages[0].content[0].CopyFrom(
            with_unknown_field(request.chat.messages[0].content[0])
        )
    return request


@pytest.mark.parametrize(
    ("where", "named"),
    [
        ("request", "GenerateRequest"),
        ("sampling_params", "sampling_params"),
        ("content", "chat.messages[0].content[0]"),
    ],
)
async def test_generate_refuses_fields_it_does_not_know(stub, cluster, where, named):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub.Generate(_unknown_in(where), timeout=BOUND_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details() and "111" in info.value.details()
    assert not cluster.tokenizer.servicer.requests


async def test_generate_max_new_tokens_above_the_context_is_invalid(stub, cluster):
    prompt = "7" * 4085  # 4085 tokens: the context leaves 11
    params = common_pb2.SamplingParams(max_new_tokens=12)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(
            stub.Generate(
                router_pb2.GenerateRequest(prompt=prompt, sampling_params=params), timeout=BOUND_S
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens is 12" in info.value.details() and "at most 11" in info.value.details()
    assert not cluster.decode.reserved
    responses = await _collect(
        stub.Generate(router_pb2.GenerateRequest(prompt=prompt), timeout=BOUND_S)
    )
    assert cluster.decode.max_new_tokens(responses[0].request_id) == 11  # the unset default, fitted


async def test_generate_passes_logit_bias_min_tokens_and_stop_token_ids(stub, cluster):
    params = common_pb2.SamplingParams(
        max_new_tokens=20,
        min_tokens=4,
        stop_token_ids=[9, 10],
        logit_bias=[
            common_pb2.LogitBias(token_id=7, bias=100),
            common_pb2.LogitBias(token_id=8, bias=-5),
        ],
    )
    await _collect(
        stub.Generate(
            router_pb2.GenerateRequest(prompt="a", sampling_params=params), timeout=BOUND_S
        )
    )
    [reserve] = cluster.decode.reserved.values()
    sent = reserve.sampling_params  # the defaults of the unset fields are written out
    assert (
        sent.max_new_tokens == 20 and sent.min_tokens == 4 and list(sent.stop_token_ids) == [9, 10]
    )
    assert [(b.token_id, b.bias) for b in sent.logit_bias] == [(7, 100.0), (8, -5.0)]
    assert cluster.prefill.requests[0].sampling_params == sent


@pytest.mark.parametrize(
    "params",
    [
        common_pb2.SamplingParams(logit_bias=[common_pb2.LogitBias(token_id=7, bias=1)] * 2),
        common_pb2.SamplingParams(logit_bias=[common_pb2.LogitBias(token_id=7, bias=100.5)]),
        common_pb2.SamplingParams(min_tokens=17),  # more than the unset max_new_tokens (16)
        common_pb2.SamplingParams(max_new_tokens=4, min_tokens=5),
    ],
)
async def test_generate_refuses_bad_logit_bias_and_min_tokens(stub, cluster, params):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(
            stub.Generate(
                router_pb2.GenerateRequest(prompt="a", sampling_params=params), timeout=BOUND_S
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not cluster.decode.reserved
