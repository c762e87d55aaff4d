"""Tracing and metrics shared by every service.

Tracing: OpenTelemetry, one span per stage, each a child of its caller's: ``router.request``
(under the client's ``traceparent``) -> ``tokenizer.tokenize``, ``decode.reserve``,
``vision_encoder.cache`` (the router's image prefetch), ``prefill.request``
(-> ``vision_encoder.encode``, ``prefill.forward``, ``kv.transfer``) and ``decode.generate``.
The W3C trace context travels in gRPC metadata: ``inject_metadata`` on the client side,
``extract_context`` on the server side. ``init_tracing`` installs the SDK
the way the ``OTEL_*`` variables say; the SDK and the OTLP exporters read their own
variables (endpoints, headers, sampler, resource), which stageserve never overrides
(``services.common.envs`` lists them).

Metrics: Prometheus, one registry per process, served over HTTP by
``start_metrics_server`` (the ``/metrics`` text format) with a ``model_name`` label on
every sample and a ``stageserve_model_info`` metric, as vLLM labels its metrics. Each
service declares its metrics in its own module through ``counter`` / ``gauge`` /
``histogram`` below so every name carries the ``stageserve_`` prefix.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)
from prometheus_client.metrics_core import Metric

from services.common.envs import Envs
from services.common.errors import StageServeError

# Stage latencies (one RPC, one batch): up to the request timeout (300 s by default).
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# vLLM's ladders, cut at the largest value a service can observe (see ``buckets_up_to``).
REQUEST_LATENCY_LADDER_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TTFT_LADDER_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_LADDER_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
TRACES_EXPORTERS = ("otlp", "console", "none")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_initialized = False


def package_version() -> str:
    try:
        return importlib.metadata.version("stageserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


@dataclass(frozen=True)
class TracingPlan:
    """What ``init_tracing`` installs: no provider at all when ``is_disabled``."""

    is_disabled: bool
    exporters: tuple[str, ...] = ()  # "otlp" and/or "console"
    protocol: str = "grpc"  # of the OTLP exporter


def tracing_plan(envs: Envs) -> TracingPlan:
    """The tracing ``envs`` asks for; ``ValueError`` naming the variable stageserve cannot
    honour."""
    if envs.otel_sdk_disabled:
        return TracingPlan(is_disabled=True)
    names = [name.strip() for name in envs.traces_exporter.split(",") if name.strip()]
    for name in names:
        if name not in TRACES_EXPORTERS:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} "
                f"(supported: {', '.join(TRACES_EXPORTERS)})"
            )
    if not envs.traces_exporter and (envs.otlp_endpoint or envs.otlp_traces_endpoint):
        names = ["otlp"]
    exporters = [name for name in names if name != "none"]
    if envs.trace_console and "console" not in exporters:
        exporters.append("console")
    protocol = envs.otlp_protocol or "grpc"
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL / OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "
            f"{protocol!r} is not supported (supported: {', '.join(OTLP_PROTOCOLS)})"
        )
    _check_sampler(envs)
    return TracingPlan(
        is_disabled=False, exporters=tuple(dict.fromkeys(exporters)), protocol=protocol
    )


def _check_sampler(envs: Envs) -> None:
    """The SDK applies OTEL_TRACES_SAMPLER itself but falls back to its default on a bad value;
    stageserve refuses to start instead."""
    sampler = envs.traces_sampler or "parentbased_always_on"
    if sampler not in SAMPLERS:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER: unsupported sampler {sampler!r} "
            f"(supported: {', '.join(SAMPLERS)})"
        )
    if not envs.traces_sampler_arg:
        return
    if sampler not in _RATIO_SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG is set but the sampler {sampler!r} takes none")
    try:
        ratio = float(envs.traces_sampler_arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        arg = envs.traces_sampler_arg
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {arg!r}")


def init_tracing(service_name: str, envs: Envs) -> None:
    """Install the process's tracer provider (once), as ``tracing_plan(envs)`` says.

    The resource is ``service.name=stageserve-<service>`` unless OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES say otherwise (the spec's precedence); ``stageserve.service``
    always names the component. Raises ``ValueError`` for a setting it cannot honour.
    """
    global _initialized
    if _initialized:
        return
    plan = tracing_plan(envs)
    exporters = list(span_exporters(plan))
    _initialized = True
    if plan.is_disabled:
        return
    provider = TracerProvider(
        resource=service_resource(service_name)
    )  # sampler: OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def service_resource(service_name: str) -> Resource:
    ours = {
        "service.name": f"stageserve-{service_name}",
        "service.namespace": "stageserve",
        "service.version": package_version(),
        "stageserve.service": service_name,
    }
    return Resource.create(ours).merge(OTELResourceDetector().detect())


def span_exporters(plan: TracingPlan) -> Iterator[SpanExporter]:
    """Exporters built without arguments: each reads its OTEL_EXPORTER_OTLP_* variables itself."""
    if "otlp" in plan.exporters:
        try:
            if plan.protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError(
                f"the OTLP exporter for {plan.protocol} is not importable ({exc}); "
                "reinstall stageserve, which depends on it"
            ) from exc
        yield OTLPSpanExporter()
    if "console" in plan.exporters:
        yield ConsoleSpanExporter()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"stageserve.{name}")


def mark_error(span: trace.Span, error: BaseException) -> None:
    """Status ERROR with the error's message, an exception event and ``error.type``."""
    is_ours = isinstance(error, StageServeError)
    message = error.message if is_ours else f"{type(error).__name__}: {error}"
    span.record_exception(error)
    span.set_attribute("error.type", type(error).__name__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, message))


@contextlib.contextmanager
def rpc_span(
    tracer: trace.Tracer,
    name: str,
    metadata: Iterable[tuple[str, str | bytes]] | None,
    **attributes: Any,
) -> Iterator[trace.Span]:
    """The span of one RPC's handling: a child of the caller's context in ``metadata``, current
    while the block runs; an exception leaving the block marks it (``mark_error``)."""
    with tracer.start_as_current_span(
        name,
        context=extract_context(metadata),
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except Exception as exc:  # recorded and re-raised
            mark_error(span, exc)
            raise


def inject_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """``metadata`` plus the current trace context, for an outgoing gRPC call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*metadata, *carrier.items()]


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller sent in gRPC metadata (an empty one when absent)."""
    carrier = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (metadata or ())}
    return propagate.extract(carrier)


def counter(
    name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry = REGISTRY
) -> Counter:
    return Counter(f"stageserve_{name}", doc, labelnames=labels, registry=registry)


def gauge(
    name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry = REGISTRY
) -> Gauge:
    return Gauge(f"stageserve_{name}", doc, labelnames=labels, registry=registry)


def histogram(
    name: str,
    doc: str,
    labels: Sequence[str] = (),
    buckets: Sequence[float] = LATENCY_BUCKETS_S,
    registry: CollectorRegistry = REGISTRY,
) -> Histogram:
    return Histogram(
        f"stageserve_{name}", doc, labelnames=labels, buckets=buckets, registry=registry
    )


def buckets_up_to(ladder: Sequence[float], max_value: float) -> tuple[float, ...]:
    """``ladder``'s values below ``max_value``, then ``max_value`` itself (the last finite
    bucket)."""
    return (*(b for b in ladder if b < max_value), max_value)


def count_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ModelLabelled:
    """A view of ``registry`` whose samples all carry ``model_name`` (unless they set it)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={"model_name": self._model_name, **sample.labels})
                for sample in family.samples
            ]
            yield labelled


def metrics_view(
    service: str, model_name: str, registry: CollectorRegistry = REGISTRY
) -> CollectorRegistry:
    """What ``/metrics`` serves: ``registry`` with ``model_name`` on every sample, and
    ``stageserve_model_info{model_name, service, version} 1``."""
    view = CollectorRegistry(auto_describe=False)
    view.register(ModelLabelled(registry, model_name))
    info = Info(
        "stageserve_model", "The served model and this service's stageserve version.", registry=view
    )
    info.info({"model_name": model_name, "service": service, "version": package_version()})
    return view


def start_metrics_server(port: int, host: str, *, service: str, model_name: str) -> int:
    """Serve ``/metrics`` (``metrics_view`` of this process's registry); port 0 picks a free port,
    which is returned."""
    server, _thread = start_http_server(port, addr=host, registry=metrics_view(service, model_name))
    return server.server_port
