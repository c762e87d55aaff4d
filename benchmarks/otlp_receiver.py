"""A real OTLP trace receiver for tests and benchmarks, built on ``opentelemetry-proto``: the
collector's gRPC ``TraceService`` and an HTTP ``POST /v1/traces`` handler (protobuf bodies), in
this process.

Both keep every span they receive as a ``ReceivedSpan`` (ids in hex, as W3C writes them),
and the headers each export came with.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    resource: dict[str, Any]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    status_code: int  # trace_pb2.Status.STATUS_CODE_*
    status_message: str
    attributes: dict[str, Any]
    event_names: tuple[str, ...]
    start_ns: int  # wall clock, ns since the epoch
    end_ns: int


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class OtlpReceiver:
    """Collects spans; ``start_grpc`` / ``start_http`` return the endpoint to export to."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    headers: list[dict[str, str]] = field(
        default_factory=list
    )  # one per export call, lower-case keys
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: Callable[[], None] | None = None

    def add(
        self, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]
    ) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                received.extend(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        resource=resource,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        status_code=span.status.code,
                        status_message=span.status.message,
                        attributes=_attributes(span.attributes),
                        event_names=tuple(event.name for event in span.events),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                    for span in scope_spans.spans
                )
        with self._lock:
            self.spans.extend(received)
            self.headers.append(headers)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        """The spans received so far, once ``predicate`` holds on them (AssertionError after
        ``timeout_s``)."""
        deadline_mono = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline_mono:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"spans not received within {timeout_s:.0f} s; got {names}")
            time.sleep(0.05)

    def start_grpc(self) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_GrpcTraceService(self), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._stop = lambda: server.stop(None)
        return f"http://127.0.0.1:{port}"

    def start_http(self) -> str:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver.add(request, {k.lower(): v for k, v in self.headers.items()})
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="otlp-http").start()

        def stop() -> None:
            server.shutdown()
            server.server_close()

        self._stop = stop
        return f"http://127.0.0.1:{server.server_address[1]}"

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


class _GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(  # noqa: N802 (the proto's name)
        self, request: Any, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        headers = {key.lower(): value for key, value in context.invocation_metadata()}
        self._receiver.add(request, headers)
        return trace_service_pb2.ExportTraceServiceResponse()
