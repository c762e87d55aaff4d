"""Prometheus metrics of the prefill service (names get the ``stageserve_`` prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common import telemetry
from services.common.errors import StageServeError

if TYPE_CHECKING:
    from services.prefill.messages import RankPlan
    from services.prefill.prefix_cache import PrefixIndex

REQUESTS = telemetry.counter(
    "prefill_requests_total",
    "Prefill requests by outcome (ok or the gRPC status name, lower case)",
    ["outcome"],
)
LATENCY_S = telemetry.histogram(
    "prefill_latency_seconds",
    "Time from a Prefill call's arrival to its first token with the KV written (prefill's part of TTFT)",
)
BATCH_SIZE = telemetry.histogram(
    "prefill_batch_size",
    "Requests per prefill (EXTEND) batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
BATCH_TOKENS = telemetry.histogram(
    "prefill_batch_tokens",
    "Prompt tokens per prefill batch",
    buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768),
)
FORWARD_S = telemetry.histogram(
    "prefill_forward_seconds", "Forward pass and first-token sampling of one batch"
)
KV_BYTES = telemetry.counter(
    "prefill_kv_transfer_bytes_total", "KV bytes written into decode's pages"
)
KV_TRANSFER_S = telemetry.histogram(
    "prefill_kv_transfer_seconds", "Time of one request's batched KV write"
)
PREFIX_CACHE_QUERIES = telemetry.counter(
    "prefill_prefix_cache_queries_total",
    "Prompt tokens of the requests planned while the prefix cache is on",
)
PREFIX_CACHE_HITS = telemetry.counter(
    "prefill_prefix_cache_hits_total",
    "Prompt tokens whose KV a plan read from the prefix cache instead of computing it",
)
PREFIX_CACHE_HOST_HITS = telemetry.counter(
    "prefill_prefix_cache_host_hits_total",
    "Prompt tokens of the cache hits whose pages a rank copied back from its host tier",
)
PREFIX_CACHE_SPILLS = telemetry.counter(
    "prefill_prefix_cache_host_spills_total",
    "KV pages ranks copied from device memory into their host tier when evicted",
)
PREFIX_CACHE_STORE_HITS = telemetry.counter(
    "prefill_prefix_cache_store_hits_total",
    "Prompt tokens of the cache hits whose pages ranks read from the shared KV store",
)
PREFIX_CACHE_STORE_FAILURES = telemetry.counter(
    "prefill_prefix_cache_store_failures_total",
    "Calls to the shared KV store that failed or timed out (the tier is skipped for them): "
    "lookup (the leader's), fetch (a batch that read it, run again without)",
    ["op"],
)
PREFIX_CACHE_PAGES = telemetry.gauge(
    "prefill_prefix_cache_pages",
    "KV pages a rank keeps for the prefix cache between plans, per tier (device: evictable "
    "when a plan needs them; host: the --host-cache-gb copies)",
    ["rank", "tier"],
)
EMBEDDING_ROWS_USED = telemetry.gauge(
    "prefill_embedding_rows_used",
    "Embedding buffer rows held by requests (encoding, waiting or quarantined)",
)
IMAGE_STORE_BYTES = telemetry.gauge(
    "prefill_image_store_bytes", "Image bytes held for calls that name an image by hash alone"
)
QUEUED = telemetry.gauge(
    "prefill_queued_requests", "Requests waiting for a batch (queued, encoding or ready)"
)
SATURATION = telemetry.gauge(
    "prefill_saturation",
    "How full this prefill worker is, 0..1: the larger of its queue's use (live requests over "
    "--max-queued-requests) and the prompt tokens waiting for a batch over --max-batch-tokens "
    "(PrefillScheduler.saturation). The autoscaling signal of deploy/k8s/components.",
)

STALLED = telemetry.gauge(
    "prefill_stalled",
    "1 while the rank worker is stuck (a plan in flight, no progress for --watchdog-s); "
    "0 otherwise",
)


def outcome_label(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    if isinstance(error, StageServeError):
        return error.grpc_code.lower()
    return "internal"


def record_prefix_plan(prefix: PrefixIndex, payload: RankPlan, num_tokens: int) -> None:
    """The prefix cache's counters and gauges once ``payload`` is planned."""
    num_hit = sum(len(r.prefix_keys) for r in payload.requests) * prefix.page_size
    PREFIX_CACHE_QUERIES.inc(num_tokens)
    PREFIX_CACHE_HITS.inc(num_hit)
    loaded = {k for m in payload.moves for k in m.load}
    PREFIX_CACHE_HOST_HITS.inc(
        prefix.page_size * sum(k in loaded for r in payload.requests for k in r.prefix_keys)
    )
    PREFIX_CACHE_SPILLS.inc(sum(len(m.spill) for m in payload.moves))
    fetched = {k for m in payload.moves for k in m.fetch}
    PREFIX_CACHE_STORE_HITS.inc(
        prefix.page_size * sum(k in fetched for r in payload.requests for k in r.prefix_keys)
    )
    for rank in range(prefix.num_ranks):
        PREFIX_CACHE_PAGES.labels(str(rank), "device").set(prefix.num_held(rank))
        PREFIX_CACHE_PAGES.labels(str(rank), "host").set(prefix.num_host_held(rank))
