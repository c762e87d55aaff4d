"""Prometheus metrics of the decode service (names get the ``stageserve_`` prefix)."""

from __future__ import annotations

from services.common import telemetry

# outcome: stop | length (finished), aborted, expired (deadline passed before generate),
# failed (its rank died or stopped, or its running deadline passed), rejected (no pages at
# Reserve), invalid (bad Reserve)
REQUESTS = telemetry.counter("decode_requests_total", "Decode requests by outcome", ["outcome"])
RUNNING_REQUESTS = telemetry.gauge(
    "decode_running_requests", "Requests generating (running or joining)"
)
RESERVED_REQUESTS = telemetry.gauge(
    "decode_reserved_requests", "Requests holding pages, waiting for KV"
)
KV_PAGES_USED = telemetry.gauge("decode_kv_pages_used", "KV pages held by requests")
KV_PAGES_FREE = telemetry.gauge("decode_kv_pages_free", "KV pages free")
KV_CACHE_USAGE = telemetry.gauge(
    "kv_cache_usage_perc",
    "Fraction of the KV pool not free (held by requests or quarantined); 1 = full",
)
KV_PAGES_QUARANTINED = telemetry.gauge(
    "decode_kv_pages_quarantined",
    "KV pages of failed reservations resting until no late KV write can land",
)
RANKS_SERVING = telemetry.gauge("decode_ranks_serving", "DP ranks formed, warm and taking requests")
RANK_FAILURES = telemetry.counter(
    "decode_rank_failures_total", "DP rank failures (each ends the rank's requests)"
)
STEP_TIME = telemetry.histogram(
    "decode_step_seconds",
    "One decode step of a rank: from the previous step read (or its launch, after an idle rank) "
    "to its read",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PREFILL_WAIT = telemetry.counter(
    "decode_prefill_wait_seconds_total",
    "Time decode ranks held a step back while a prefill forward on their GPU ran "
    "(--gpu-share-file); not in decode_step_seconds",
)
BATCH_SIZE = telemetry.histogram(
    "decode_batch_size",
    "Requests in one decode step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
TOKENS_GENERATED = telemetry.counter(
    "decode_tokens_generated_total", "Tokens sampled by decode steps"
)
STEPS = telemetry.counter(
    "decode_steps_total", "Decode steps read (each one rank's whole running batch)", ["dp_rank"]
)
STREAM_MESSAGES = telemetry.counter(
    "decode_stream_messages_total",
    "Messages decode sent on Stream calls (each: every new token of its stream)",
)
