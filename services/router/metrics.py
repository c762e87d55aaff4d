"""The router's Prometheus metrics (names get the ``stageserve_`` prefix).

One ``RouterMetrics`` per router; tests give each its own registry.
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from services.common import telemetry
from services.common.types import Usage

TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = telemetry.counter(
            "router_requests_total", "Requests the router finished, by endpoint and outcome "
            "(ok or the error type).", ("endpoint", "outcome"), registry=registry,
        )
        self.in_flight = telemetry.gauge(
            "router_requests_in_flight", "Requests being served now.", registry=registry
        )
        self.ttft = telemetry.histogram(
            "router_time_to_first_token_seconds", "From request arrival to the first generated token.",
            registry=registry,
        )
        self.inter_token = telemetry.histogram(
            "router_inter_token_latency_seconds", "Time between consecutive token messages of a request.",
            buckets=TOKEN_LATENCY_BUCKETS_S, registry=registry,
        )
        self.e2e = telemetry.histogram(
            "router_e2e_latency_seconds", "From request arrival to its last byte, by endpoint.",
            ("endpoint",), registry=registry,
        )
        self.prompt_tokens = telemetry.counter(
            "router_prompt_tokens_total", "Prompt tokens of finished requests.", registry=registry
        )
        self.completion_tokens = telemetry.counter(
            "router_completion_tokens_total", "Generated tokens of finished requests.", registry=registry
        )
        self.worker_ready = telemetry.gauge(
            "router_worker_ready", "1 when the worker passes its health check, else 0.",
            ("kind", "address"), registry=registry,
        )
        self.workers_ready = telemetry.gauge(
            "router_workers_ready", "Workers of each kind that pass their health check.", ("kind",),
            registry=registry,
        )
        self.worker_in_flight = telemetry.gauge(
            "router_worker_requests_in_flight", "Requests this router has routed to the worker and not "
            "finished.", ("kind", "address"), registry=registry,
        )
        self._add_flow_metrics(registry)

    def _add_flow_metrics(self, registry: CollectorRegistry) -> None:
        """Admission (slots, queue, 429s), stalls and retries on another worker."""
        self.admission_running = telemetry.gauge(
            "router_admission_running", "Requests past tokenization holding one of the "
            "--max-concurrent-requests slots.", registry=registry,
        )
        self.admission_queued = telemetry.gauge(
            "router_admission_queued", "Requests waiting in the admission queue, for a slot or for "
            "decode's KV pages.", registry=registry,
        )
        self.admission_rejected = telemetry.counter(
            "router_admission_rejected_total", "Requests refused with 429, by reason (queue_full, "
            "queue_timeout, kv_capacity).", ("reason",), registry=registry,
        )
        self.admission_wait = telemetry.histogram(
            "router_admission_wait_seconds", "Time a request waited in the admission queue in all "
            "(for a slot and for KV pages), observed once it stops waiting.", registry=registry,
        )
        self.kv_refusals = telemetry.counter(
            "router_kv_refusals_total", "Reserve calls a decode worker answered RESOURCE_EXHAUSTED.",
            ("address",), registry=registry,
        )
        self.worker_stalls = telemetry.counter(
            "router_worker_stalls_total", "Calls a worker made no progress on within "
            "--stall-timeout-s, by hop (tokenize, reserve, prefill, generate).", ("hop", "address"),
            registry=registry,
        )
        self.worker_retries = telemetry.counter(
            "router_worker_retries_total", "Requests moved to another worker of the kind after an "
            "unavailable or stalled call.", ("kind",), registry=registry,
        )

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


class RequestTracker:
    """One request's count, in-flight gauge and end-to-end latency; ``finish`` once with its outcome."""

    def __init__(self, metrics: RouterMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._started = time.perf_counter()
        self._is_finished = False
        metrics.in_flight.inc()

    def finish(self, outcome: str, usage: Usage | None = None) -> None:
        """Record the outcome ("ok" or an error type); later calls are ignored."""
        if self._is_finished:
            return
        self._is_finished = True
        metrics = self._metrics
        metrics.in_flight.dec()
        metrics.requests.labels(self._endpoint, outcome).inc()
        metrics.e2e.labels(self._endpoint).observe(time.perf_counter() - self._started)
        if usage is not None:
            metrics.prompt_tokens.inc(usage.num_prompt_tokens)
            metrics.completion_tokens.inc(usage.num_completion_tokens)
