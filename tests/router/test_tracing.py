"""The router continues its caller's trace (HTTP ``traceparent`` header, gRPC metadata) with
its own code, marks a failed request's spans ERROR and puts ``gen_ai.*`` attributes on them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.client import create_channel
from services.common.errors import UnavailableError
from services.common.pb.stageserve.v1 import router_pb2, router_pb2_grpc
from tests.conftest import sdk_provider
from tests.router.conftest import BOUND_S, MODEL_NAME

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 50,
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


def only(exporter: InMemorySpanExporter, name: str):
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


async def test_http_request_continues_the_callers_traceparent(http, spans):
    response = await http.post(
        "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 200, response.text
    root = only(spans, "router.request")
    assert trace.format_trace_id(root.context.trace_id) == TRACE_ID
    assert root.parent is not None and trace.format_span_id(root.parent.span_id) == PARENT_ID
    assert root.parent.is_remote
    assert root.status.status_code is trace.StatusCode.UNSET


async def test_http_request_without_traceparent_starts_a_trace(http, spans):
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert only(spans, "router.request").parent is None


async def test_request_span_has_the_gen_ai_attributes(http, spans, cluster):
    body = {**CHAT, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["zzz"]}
    response = await http.post("/v1/chat/completions", json=body)
    usage = response.json()["usage"]
    attributes = only(spans, "router.request").attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == MODEL_NAME
    assert attributes["gen_ai.response.id"] == attributes["request_id"] == response.json()["id"]
    assert (attributes["gen_ai.request.temperature"], attributes["gen_ai.request.top_p"]) == (
        0.5,
        0.9,
    )
    assert attributes["gen_ai.request.seed"] == 7 and attributes["gen_ai.request.max_tokens"] == 50
    assert attributes["gen_ai.request.stop_sequences"] == ("zzz",)
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert 0 <= attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]


async def test_a_failed_request_ends_its_span_with_error_status(http, spans, cluster):
    cluster.script.prefill_error = UnavailableError("prefill exploded")
    response = await http.post(
        "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 503
    root = only(spans, "router.request")
    assert root.status.status_code is trace.StatusCode.ERROR
    assert "prefill exploded" in root.status.description
    assert root.attributes["error.type"] == "UnavailableError"
    [event] = [e for e in root.events if e.name == "exception"]
    assert event.attributes["exception.type"].endswith(".UnavailableError")


@pytest.fixture
async def stub(router) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    channel = create_channel(f"127.0.0.1:{router.grpc_port}")
    yield router_pb2_grpc.RouterStub(channel)
    await channel.close()


async def test_grpc_generate_continues_the_callers_traceparent(stub, spans):
    request = router_pb2.GenerateRequest(prompt="Once")
    metadata = [("traceparent", TRACEPARENT)]
    responses = [r async for r in stub.Generate(request, timeout=BOUND_S, metadata=metadata)]
    assert responses[-1].usage.num_completion_tokens > 0
    rpc, inner = only(spans, "router.generate_rpc"), only(spans, "router.request")
    assert trace.format_trace_id(rpc.context.trace_id) == TRACE_ID
    assert trace.format_span_id(rpc.parent.span_id) == PARENT_ID
    assert (
        inner.parent.span_id == rpc.context.span_id
        and inner.context.trace_id == rpc.context.trace_id
    )
    assert inner.attributes["gen_ai.operation.name"] == "text_completion"


async def test_a_failed_grpc_generate_marks_both_spans(stub, spans, cluster):
    cluster.script.prefill_error = UnavailableError("prefill exploded")
    request = router_pb2.GenerateRequest(prompt="Once")
    with pytest.raises(Exception, match="prefill exploded"):
        [r async for r in stub.Generate(request, timeout=BOUND_S)]
    for name in ("router.generate_rpc", "router.request"):
        assert only(spans, name).status.status_code is trace.StatusCode.ERROR, name
