"""The router's Prometheus metrics (names get the ``stageserve_`` prefix).

One ``RouterMetrics`` per router; tests give each its own registry. The per-request
metrics carry vLLM's names (``vllm:X`` is ``stageserve_X``) where the meaning is the same;
``/metrics`` adds the ``model_name`` label (``telemetry.metrics_view``). The router sees
every request once, so it is the one service that records them:

  arrival (tokenization starts) -> queue (admission: a slot, decode's KV pages)
  -> prefill (Reserve on decode, then prefill: its queue, the images, the forward and the
  KV write, until the first token) -> decode (first token to last) -> finished

``RequestTracker`` records what the API layer sees (outcome, end-to-end latency, token
counts); ``RequestStats`` the timeline inside the pipeline.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from services.common import telemetry
from services.common.telemetry import (
    REQUEST_LATENCY_LADDER_S,
    TOKEN_LATENCY_LADDER_S,
    TTFT_LADDER_S,
    buckets_up_to,
    count_buckets,
)
from services.common.types import FinishReason, Usage
from services.router.types import GenerationDelta

DEFAULT_MAX_LATENCY_S = 300.0  # the router's default --request-timeout-s
DEFAULT_MAX_MODEL_LEN = 32768


class RouterMetrics:
    """``max_latency_s`` (the request timeout) ends the latency buckets, ``max_model_len``
    the token-count ones."""

    def __init__(
        self,
        registry: CollectorRegistry = REGISTRY,
        *,
        max_latency_s: float = DEFAULT_MAX_LATENCY_S,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        self.registry = registry
        self._add_api_metrics(registry, max_latency_s, max_model_len)
        self._add_request_metrics(registry, max_latency_s, max_model_len)
        self._add_worker_metrics(registry)
        self._add_flow_metrics(registry)

    def _add_api_metrics(
        self, registry: CollectorRegistry, max_latency_s: float, max_model_len: int
    ) -> None:
        """What ``RequestTracker`` records."""
        r, tokens = registry, count_buckets(max_model_len)
        self.requests = telemetry.counter(
            "router_requests_total",
            "Requests the router finished, by endpoint and outcome (ok or the error type).",
            ("endpoint", "outcome"),
            registry=r,
        )
        self.in_flight = telemetry.gauge(
            "router_requests_in_flight", "Requests being served now.", registry=r
        )
        self.e2e = telemetry.histogram(
            "e2e_request_latency_seconds",
            "From a request's arrival to its last byte, for requests that succeeded, by endpoint.",
            ("endpoint",),
            buckets=buckets_up_to(REQUEST_LATENCY_LADDER_S, max_latency_s),
            registry=r,
        )
        self.prompt_tokens = telemetry.counter(
            "prompt_tokens_total", "Prompt tokens of requests that succeeded.", registry=r
        )
        self.generation_tokens = telemetry.counter(
            "generation_tokens_total", "Generated tokens of requests that succeeded.", registry=r
        )
        self.request_prompt_tokens = telemetry.histogram(
            "request_prompt_tokens",
            "Prompt tokens per request that succeeded.",
            buckets=tokens,
            registry=r,
        )
        self.request_generation_tokens = telemetry.histogram(
            "request_generation_tokens",
            "Generated tokens per request that succeeded.",
            buckets=tokens,
            registry=r,
        )

    def _add_request_metrics(
        self, registry: CollectorRegistry, max_latency_s: float, max_model_len: int
    ) -> None:
        """What ``RequestStats`` records (the phases in the module docstring)."""
        r = registry
        request_buckets = buckets_up_to(REQUEST_LATENCY_LADDER_S, max_latency_s)
        token_buckets = buckets_up_to(TOKEN_LATENCY_LADDER_S, max_latency_s)
        self.ttft = telemetry.histogram(
            "time_to_first_token_seconds",
            "From a request's arrival (tokenization starts) to its first generated token.",
            buckets=buckets_up_to(TTFT_LADDER_S, max_latency_s),
            registry=r,
        )
        self.inter_token = telemetry.histogram(
            "inter_token_latency_seconds",
            "Time between two generated tokens of a request (a "
            "message of k tokens counts its gap / k, k times).",
            buckets=token_buckets,
            registry=r,
        )
        self.time_per_output_token = telemetry.histogram(
            "time_per_output_token_seconds",
            "The same samples as inter_token_latency_seconds (vLLM's older name for them).",
            buckets=token_buckets,
            registry=r,
        )
        self.request_tpot = telemetry.histogram(
            "request_time_per_output_token_seconds",
            "Per finished request: decode time / (generated "
            "tokens - 1), for requests of two or more tokens.",
            buckets=token_buckets,
            registry=r,
        )
        self._add_request_outcomes(r, request_buckets, max_model_len)

    def _add_request_outcomes(
        self, r: CollectorRegistry, request_buckets: tuple[float, ...], max_model_len: int
    ) -> None:
        phases = {
            "queue": "In the admission queue, waiting for a slot and for decode's KV pages.",
            "prefill": "From leaving the queue (Reserve on decode, then prefill's queue, images, "
            "forward and KV write) to the first token.",
            "decode": "From the first generated token to the last.",
            "inference": "Prefill time plus decode time.",
        }
        self.phase_time = {
            phase: telemetry.histogram(
                f"request_{phase}_time_seconds",
                f"{doc} Per finished request.",
                buckets=request_buckets,
                registry=r,
            )
            for phase, doc in phases.items()
        }
        self.request_success = telemetry.counter(
            "request_success_total",
            "Requests that finished, by finish reason (stop, length).",
            ("finished_reason",),
            registry=r,
        )
        for reason in FinishReason:  # every series exists from the start, as vLLM's do
            self.request_success.labels(reason.value)
        self.request_max_tokens = telemetry.histogram(
            "request_params_max_tokens",
            "The max_tokens a finished request asked for (requests that set it).",
            buckets=count_buckets(max_model_len),
            registry=r,
        )
        self.num_requests_running = telemetry.gauge(
            "num_requests_running",
            "Requests holding an admission slot (Reserve, prefill or decode).",
            registry=r,
        )
        self.num_requests_waiting = telemetry.gauge(
            "num_requests_waiting", "Requests in the admission queue.", registry=r
        )

    def _add_worker_metrics(self, registry: CollectorRegistry) -> None:
        self.worker_ready = telemetry.gauge(
            "router_worker_ready",
            "1 when the worker passes its health check, else 0.",
            ("kind", "address"),
            registry=registry,
        )
        self.workers_ready = telemetry.gauge(
            "router_workers_ready",
            "Workers of each kind that pass their health check.",
            ("kind",),
            registry=registry,
        )
        self.worker_in_flight = telemetry.gauge(
            "router_worker_requests_in_flight",
            "Requests this router has routed to the worker and not finished.",
            ("kind", "address"),
            registry=registry,
        )

    def _add_flow_metrics(self, registry: CollectorRegistry) -> None:
        """Admission (slots, queue, 429s), stalls and retries on another worker."""
        self.admission_running = telemetry.gauge(
            "router_admission_running",
            "Requests past tokenization holding one of the --max-concurrent-requests slots.",
            registry=registry,
        )
        self.admission_queued = telemetry.gauge(
            "router_admission_queued",
            "Requests waiting in the admission queue, for a slot or for decode's KV pages.",
            registry=registry,
        )
        self.admission_rejected = telemetry.counter(
            "router_admission_rejected_total",
            "Requests refused with 429, by reason "
            "(queue_full, queue_timeout, kv_capacity, prefill_capacity).",
            ("reason",),
            registry=registry,
        )
        self.admission_wait = telemetry.histogram(
            "router_admission_wait_seconds",
            "Time a request waited in the admission queue in all "
            "(for a slot, KV pages and prefill's queue), observed once it stops waiting.",
            registry=registry,
        )
        self.kv_refusals = telemetry.counter(
            "router_kv_refusals_total",
            "Reserve calls a decode worker answered RESOURCE_EXHAUSTED.",
            ("address",),
            registry=registry,
        )
        self.prefill_refusals = telemetry.counter(
            "router_prefill_refusals_total",
            "Prefill calls a prefill worker answered RESOURCE_EXHAUSTED (its queue full).",
            ("address",),
            registry=registry,
        )
        self.worker_stalls = telemetry.counter(
            "router_worker_stalls_total",
            "Calls a worker made no progress on within "
            "--stall-timeout-s, by hop (tokenize, reserve, prefill, generate).",
            ("hop", "address"),
            registry=registry,
        )
        self.worker_retries = telemetry.counter(
            "router_worker_retries_total",
            "Requests moved to another worker of the kind after an unavailable or stalled call.",
            ("kind",),
            registry=registry,
        )

    def set_admission(self, num_running: int, num_queued: int) -> None:
        """The admission manager's counts, under its own names and vLLM's."""
        self.admission_running.set(num_running)
        self.num_requests_running.set(num_running)
        self.admission_queued.set(num_queued)
        self.num_requests_waiting.set(num_queued)

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
        """Record the outcome ("ok" or an error type) and, for "ok", its latency and ``usage``;
        later calls are ignored."""
        if self._is_finished:
            return
        self._is_finished = True
        metrics = self._metrics
        metrics.in_flight.dec()
        metrics.requests.labels(self._endpoint, outcome).inc()
        if outcome != "ok":
            return
        metrics.e2e.labels(self._endpoint).observe(time.perf_counter() - self._started)
        if usage is not None:
            metrics.prompt_tokens.inc(usage.num_prompt_tokens)
            metrics.generation_tokens.inc(usage.num_completion_tokens)
            metrics.request_prompt_tokens.observe(usage.num_prompt_tokens)
            metrics.request_generation_tokens.observe(usage.num_completion_tokens)


class RequestStats:
    """One request's timeline in the pipeline (``time.perf_counter`` seconds).

    ``tokens`` observes TTFT and inter-token gaps as tokens arrive; ``finish`` (the last
    delta, once) the per-request histograms and the ``gen_ai.*`` results on ``span``.
    """

    def __init__(self, metrics: RouterMetrics, span: trace.Span, started: float) -> None:
        self._metrics = metrics
        self._span = span
        self._started = started
        self._queue_s = self._prefill_s = 0.0
        self._first_token_at: float | None = None
        self._last_token_at = started

    def placed(self, queue_s: float, place_s: float) -> None:
        """Placement took ``place_s``, of which ``queue_s`` waiting in the admission queue."""
        self._queue_s, self._prefill_s = queue_s, max(0.0, place_s - queue_s)

    def tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        metrics = self._metrics
        if self._first_token_at is None:
            self._first_token_at = now
            metrics.ttft.observe(now - self._started)
        else:
            gap_s = (now - self._last_token_at) / num_tokens
            for _ in range(num_tokens):
                metrics.inter_token.observe(gap_s)
                metrics.time_per_output_token.observe(gap_s)
        self._last_token_at = now

    def finish(self, delta: GenerationDelta, max_tokens: int | None) -> None:
        assert delta.finish_reason is not None and delta.usage is not None
        metrics, usage = self._metrics, delta.usage
        first_at = self._first_token_at if self._first_token_at is not None else self._last_token_at
        decode_s = self._last_token_at - first_at
        times = {
            "queue": self._queue_s,
            "prefill": self._prefill_s,
            "decode": decode_s,
            "inference": self._prefill_s + decode_s,
        }
        for phase, seconds in times.items():
            metrics.phase_time[phase].observe(seconds)
        if usage.num_completion_tokens > 1:
            metrics.request_tpot.observe(decode_s / (usage.num_completion_tokens - 1))
        metrics.request_success.labels(delta.finish_reason.value).inc()
        if max_tokens is not None:
            metrics.request_max_tokens.observe(max_tokens)
        self._span.set_attributes(
            {
                "gen_ai.usage.input_tokens": usage.num_prompt_tokens,
                "gen_ai.usage.output_tokens": usage.num_completion_tokens,
                "gen_ai.response.finish_reasons": (delta.finish_reason.value,),
                "gen_ai.latency.time_to_first_token": first_at - self._started,
                "gen_ai.latency.time_in_queue": self._queue_s,
                "gen_ai.latency.time_in_model_prefill": self._prefill_s,
                "gen_ai.latency.time_in_model_decode": decode_s,
                "gen_ai.latency.e2e": self._last_token_at - self._started,
            }
        )
