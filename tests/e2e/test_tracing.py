"""One trace per request across all five services, exported over OTLP to a real receiver
(``benchmarks.otlp_receiver``) in this process, once per protocol.

The request carries a client ``traceparent``; its spans must form one trace under it with
the stage links the design names, and no orphan: router.request -> tokenizer.tokenize,
decode.reserve, vision_encoder.cache (the router's image prefetch), prefill.request
(-> vision_encoder.encode, prefill.forward, kv.transfer), decode.generate. A failed request's
root span has status ERROR.
"""

from __future__ import annotations

import base64
import os

import httpx
import pytest

from benchmarks.otlp_receiver import STATUS_ERROR, OtlpReceiver, ReceivedSpan
from tests.conftest import image_bytes
from tests.e2e.system import running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SERVICES = {"router", "tokenizer", "vision_encoder", "prefill", "decode"}
PARENTS = {  # span -> the span it must be a child of
    "tokenizer.tokenize": "router.request",
    "decode.reserve": "router.request",
    "prefill.request": "router.request",
    "vision_encoder.cache": "router.request",  # the router's prefetch of the image
    "vision_encoder.encode": "prefill.request",
    "prefill.forward": "prefill.request",
    "kv.transfer": "prefill.request",
    "decode.generate": "router.request",
}
EXPORT_TIMEOUT_S = 60


def traceparent(trace_id: str, parent_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{parent_id}-01"}


@pytest.fixture(scope="module", params=["grpc", "http/protobuf"])
def traced(request, tmp_path_factory):
    """(system, receiver): ``stageserve up`` exporting to a receiver of the protocol."""
    receiver = OtlpReceiver()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: export soon after each span ends
    if request.param == "grpc":  # the generic variables
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.start_grpc(), OTEL_EXPORTER_OTLP_PROTOCOL="grpc"
        )
    else:  # the per-signal ones
        env.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.start_http()}/v1/traces",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
        )
    try:
        with running_system(
            tmp_path_factory.mktemp("traced"), "--num-pages", "512", env=env
        ) as system:
            yield system, receiver
    finally:
        receiver.stop()


def chat_body(system, text: str) -> dict:
    image = base64.b64encode(image_bytes(64, 48, seed=5)).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": text},
    ]
    return {
        "model": "tiny-qwen2.5-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    }


def in_trace(trace_id: str, names: set[str]):
    def predicate(spans: list[ReceivedSpan]) -> bool:
        return names <= {s.name for s in spans if s.trace_id == trace_id}

    return predicate


def test_one_request_is_one_trace_across_all_five_services(traced) -> None:
    system, receiver = traced
    trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    response = httpx.post(
        f"{system.base_url}/chat/completions",
        json=chat_body(system, "What is this?"),
        headers=traceparent(trace_id, client_span),
        timeout=120,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    spans = receiver.wait_for(in_trace(trace_id, {"router.request", *PARENTS}), EXPORT_TIMEOUT_S)
    trace = [s for s in spans if s.trace_id == trace_id]
    assert {s.resource["stageserve.service"] for s in trace} == SERVICES
    assert {s.service for s in trace} == {f"stageserve-{name}" for name in SERVICES}
    by_name = {}
    for span in trace:
        assert span.name not in by_name, f"two {span.name} spans in one request's trace"
        by_name[span.name] = span
    root = by_name["router.request"]
    assert root.parent_span_id == client_span
    for name, parent in PARENTS.items():
        assert by_name[name].parent_span_id == by_name[parent].span_id, (
            f"{name} is not {parent}'s child"
        )
    ids = {s.span_id for s in trace} | {client_span}
    assert all(s.parent_span_id in ids for s in trace), "an orphan span"
    # only the stage spans: no framework's own (FastAPI traces requests unless told not to)
    assert set(by_name) == {"router.request", *PARENTS}
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["gen_ai.request.model"] == "tiny-qwen2.5-vl"
    assert all(s.status_code != STATUS_ERROR for s in trace)


def test_a_failed_request_has_an_error_root_span(traced) -> None:
    system, receiver = traced
    trace_id, client_span = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"
    too_long = "moon " * 5000  # more tokens than the tiny model's context (4096)
    response = httpx.post(
        f"{system.base_url}/chat/completions",
        json=chat_body(system, too_long),
        headers=traceparent(trace_id, client_span),
        timeout=120,
    )
    assert response.status_code == 400, response.text
    spans = receiver.wait_for(
        in_trace(trace_id, {"router.request", "tokenizer.tokenize"}), EXPORT_TIMEOUT_S
    )
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    root = by_name["router.request"]
    assert root.parent_span_id == client_span
    assert root.status_code == STATUS_ERROR and "exception" in root.event_names
    assert root.attributes["error.type"] == "InvalidRequestError"
    assert by_name["tokenizer.tokenize"].status_code == STATUS_ERROR
    assert "prefill.request" not in by_name  # it ended at the tokenizer
