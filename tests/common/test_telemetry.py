"""Telemetry: which exporters the ``OTEL_*`` variables ask for (and the values refused at start-up),
real OTLP export over both protocols with the SDK's own variable handling, the resource's
precedence, span errors, and ``/metrics`` with ``model_name`` on every sample."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.otlp_receiver import OtlpReceiver
from services.common import telemetry
from services.common.envs import Envs
from services.common.errors import CapacityError
from services.common.server import RpcMetrics


def plan(**env: str) -> telemetry.TracingPlan:
    return telemetry.tracing_plan(Envs.from_environ(env))


def test_no_exporter_unless_an_endpoint_or_exporter_is_named() -> None:
    assert plan() == telemetry.TracingPlan(is_disabled=False, exporters=(), protocol="grpc")
    assert plan(OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4317").exporters == ("otlp",)
    assert plan(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://c:4318/v1/traces").exporters == ("otlp",)
    assert plan(OTEL_TRACES_EXPORTER="otlp").exporters == ("otlp",)  # the SDK's default endpoint
    assert (
        plan(OTEL_TRACES_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4317").exporters
        == ()
    )
    assert plan(OTEL_TRACES_EXPORTER="console,otlp").exporters == ("console", "otlp")
    assert plan(STAGESERVE_TRACE_CONSOLE="1").exporters == ("console",)
    assert plan(OTEL_SDK_DISABLED="TRUE", OTEL_TRACES_EXPORTER="otlp").is_disabled


def test_the_per_signal_protocol_wins() -> None:
    assert plan(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf").protocol == "http/protobuf"
    both = plan(
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf"
    )
    assert both.protocol == "http/protobuf"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"}, "'thrift' is not supported"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: unsupported exporter 'zipkin'"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER: unsupported sampler"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "in [0, 1]"),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
            "in [0, 1]",
        ),
        ({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "0.5"}, "takes none"),
    ],
)
def test_settings_the_sdk_cannot_honour_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(**env)


def test_a_ratio_sampler_with_its_argument_is_accepted() -> None:
    ratio = plan(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.25")
    assert not ratio.is_disabled


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_a_real_otlp_receiver(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpReceiver()
    endpoint = receiver.start_grpc() if protocol == "grpc" else receiver.start_http()
    try:
        if protocol == "grpc":  # the generic variables
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=blue")
        else:  # the per-signal ones, used as they are (no /v1/traces appended)
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{endpoint}/v1/traces")
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=blue")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-router")
        chosen = telemetry.tracing_plan(
            Envs.from_environ(
                {"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_TRACES_EXPORTER": "otlp"}
            )
        )
        (exporter,) = telemetry.span_exporters(chosen)
        provider = TracerProvider(resource=telemetry.service_resource("router"))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("test").start_as_current_span("stage"):
            pass
        provider.shutdown()
        (span,) = receiver.wait_for(lambda spans: len(spans) == 1, timeout_s=30)
        assert (span.name, span.service) == ("stage", "my-router")  # OTEL_SERVICE_NAME wins
        assert span.resource["stageserve.service"] == "router"
        assert receiver.headers[0]["x-tenant"] == "blue"
    finally:
        receiver.stop()


def test_the_default_service_name_names_the_component(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    attributes = telemetry.service_resource("decode").attributes
    assert attributes["service.name"] == "stageserve-decode"
    assert attributes["service.namespace"] == "stageserve"
    assert attributes["deployment.environment"] == "test"
    assert attributes["service.version"] == telemetry.package_version()


def test_rpc_span_marks_an_error_and_continues_the_caller() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        metadata = telemetry.inject_metadata([("x-request-id", "r1")])
    with pytest.raises(CapacityError):
        with telemetry.rpc_span(tracer, "decode.reserve", metadata, request_id="r1"):
            raise CapacityError("no pages")
    span = [s for s in exporter.get_finished_spans() if s.name == "decode.reserve"][0]
    assert span.parent.span_id == caller.get_span_context().span_id
    assert (
        span.status.status_code is trace.StatusCode.ERROR and span.status.description == "no pages"
    )
    assert (
        span.attributes["error.type"] == "CapacityError" and span.attributes["request_id"] == "r1"
    )
    assert [e.name for e in span.events] == ["exception"]


def test_bucket_helpers() -> None:
    assert telemetry.buckets_up_to((1.0, 5.0, 300.0, 480.0), 300.0) == (1.0, 5.0, 300.0)
    assert telemetry.buckets_up_to((1.0, 5.0, 480.0), 100.0) == (1.0, 5.0, 100.0)
    assert telemetry.count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert telemetry.LATENCY_BUCKETS_S[-1] == 300.0


def test_metrics_view_labels_every_sample_with_the_model() -> None:
    registry = CollectorRegistry()
    requests = telemetry.counter("things", "Things.", ["kind"], registry=registry)
    requests.labels("a").inc(2)
    telemetry.histogram("thing_seconds", "Thing time.", registry=registry).observe(0.2)
    view = telemetry.metrics_view("decode", "tiny", registry)
    families = {f.name: f for f in view.collect()}
    samples = [s for f in families.values() for s in f.samples]
    assert samples and all(s.labels["model_name"] == "tiny" for s in samples)
    assert families["stageserve_things"].samples[0].labels == {"model_name": "tiny", "kind": "a"}
    (info,) = families["stageserve_model"].samples
    assert info.labels == {
        "model_name": "tiny",
        "service": "decode",
        "version": telemetry.package_version(),
    }


def test_metrics_server_serves_the_view_and_the_grpc_server_metrics() -> None:
    RpcMetrics().record("/stageserve.v1.Decode/Reserve", "RESOURCE_EXHAUSTED", 0.02)
    port = telemetry.start_metrics_server(0, "127.0.0.1", service="decode", model_name="tiny")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    handled = families["stageserve_grpc_server_handled"]
    labels = {
        "model_name": "tiny",
        "grpc_service": "stageserve.v1.Decode",
        "grpc_method": "Reserve",
        "grpc_code": "RESOURCE_EXHAUSTED",
    }
    assert any(s.labels == labels and s.value >= 1 for s in handled.samples)
    assert "stageserve_grpc_server_handling_seconds" in families
    assert all(s.labels.get("model_name") == "tiny" for f in families.values() for s in f.samples)
