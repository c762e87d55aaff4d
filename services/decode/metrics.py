"""Prometheus metrics of the decode service (names get the ``stageserve_`` prefix)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common import telemetry
from services.decode.messages import RankLoad, RankReport

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
SATURATION = telemetry.gauge(
    "decode_saturation",
    "How full this decode worker is, 0..1: the larger of its KV pool's use (pages not free "
    "over all pages; at 1 a Reserve is refused) and its batch slots' (requests held, reserved "
    "or generating, over max_running_requests; at 1 new requests wait for a slot); 0 while no "
    "rank serves. The autoscaling signal of deploy/k8s/components.",
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


def saturation(loads: Sequence[RankLoad]) -> float:
    """``SATURATION`` of the serving ranks' ``loads`` (every rank's pages and slots summed)."""
    num_total_pages = sum(load.num_total_pages for load in loads)
    num_slots = sum(load.max_running_requests for load in loads)
    if not num_total_pages or not num_slots:
        return 0.0
    kv_use = 1.0 - sum(load.num_free_pages for load in loads) / num_total_pages
    num_held = sum(load.num_running_requests + load.num_reserved_requests for load in loads)
    return min(1.0, max(kv_use, num_held / num_slots))


def record_report(dp_rank: int, report: RankReport) -> None:
    """Count what a rank's report tells: requests ended, prefill waits, the step it read."""
    for done in report.finished:
        REQUESTS.labels(done.reason.value).inc()
    if report.expired:
        REQUESTS.labels("expired").inc(len(report.expired))
    if report.prefill_wait_s:
        PREFILL_WAIT.inc(report.prefill_wait_s)
    if report.num_read_rows:
        STEPS.labels(str(dp_rank)).inc()
        STEP_TIME.observe(report.read_step_s)
        BATCH_SIZE.observe(report.num_read_rows)
        TOKENS_GENERATED.inc(len(report.token_ids))


def set_load_gauges(loads: Sequence[RankLoad]) -> None:
    """Set the gauges from the serving ranks' ``loads`` (summed over them)."""
    RANKS_SERVING.set(len(loads))
    RUNNING_REQUESTS.set(sum(load.num_running_requests for load in loads))
    RESERVED_REQUESTS.set(sum(load.num_reserved_requests for load in loads))
    KV_PAGES_USED.set(sum(load.num_used_pages for load in loads))
    KV_PAGES_FREE.set(sum(load.num_free_pages for load in loads))
    KV_PAGES_QUARANTINED.set(sum(load.num_quarantined_pages for load in loads))
    total = sum(load.num_total_pages for load in loads)
    free = sum(load.num_free_pages for load in loads)
    KV_CACHE_USAGE.set(1.0 - free / total if total else 0.0)
    SATURATION.set(saturation(loads))
