"""Tracing and metrics shared by every service.

Tracing: OpenTelemetry, one span per stage (``router.request``, ``tokenizer.tokenize``,
``vision_encoder.encode``, ``prefill.forward``, ``kv.transfer``, ``decode.generate``).
The W3C trace context travels in gRPC metadata (``traceparent``): ``inject_metadata``
on the client side, ``extract_context`` on the server side. Spans are exported over
OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the exporter package is installed.

Metrics: Prometheus, one registry per process, served over HTTP by
``start_metrics_server`` (the ``/metrics`` text format). Each service declares its
metrics in its own module through ``counter`` / ``gauge`` / ``histogram`` below so
every name carries the ``stageserve_`` prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.common.envs import Envs

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_initialized = False


def init_tracing(service_name: str, envs: Envs) -> None:
    """Install the process's tracer provider (once); exporters as ``envs`` asks."""
    global _initialized
    if _initialized:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"stageserve-{service_name}"}))
    if envs.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            logger.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=envs.otlp_endpoint)))
    if envs.trace_console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _initialized = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"stageserve.{name}")


def inject_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """``metadata`` plus the current trace context, for an outgoing gRPC call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*metadata, *carrier.items()]


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller sent in gRPC metadata (an empty one when absent)."""
    carrier = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (metadata or ())}
    return propagate.extract(carrier)


def counter(name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry = REGISTRY) -> Counter:
    return Counter(f"stageserve_{name}", doc, labelnames=labels, registry=registry)


def gauge(name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry = REGISTRY) -> Gauge:
    return Gauge(f"stageserve_{name}", doc, labelnames=labels, registry=registry)


def histogram(
    name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S,
    registry: CollectorRegistry = REGISTRY,
) -> Histogram:
    return Histogram(f"stageserve_{name}", doc, labelnames=labels, buckets=buckets, registry=registry)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` for this process's registry; port 0 picks a free port, which is returned."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
