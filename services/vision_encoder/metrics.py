"""Prometheus metrics of the vision encoder (names get the ``stageserve_`` prefix).

The leader keeps them all; the per-rank ones (label ``rank``) come from each rank's step
results.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from services.common import telemetry
from services.vision_encoder.rank_messages import EncodeStepResult

_PREFIX = "vision_encoder_"
RANK = ("rank",)


class VisionEncoderMetrics:
    """One set per process (``REGISTRY``); tests pass their own registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._registry = registry
        self._add_call_metrics()
        self._add_rank_metrics()

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return telemetry.counter(_PREFIX + name, doc, labels, registry=self._registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return telemetry.gauge(_PREFIX + name, doc, labels, registry=self._registry)

    def _histogram(self, name: str, doc: str):
        return telemetry.histogram(_PREFIX + name, doc, registry=self._registry)

    def _add_call_metrics(self) -> None:
        """Calls, on the leader."""
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        registry = self._registry
        self.requests = counter(
            "requests",
            "Encode calls by outcome (ok, needs_image_data or the error class)",
            ("outcome",),
        )
        self.cache_hits = counter(
            "cache_hits", "Image spans whose rows needed no ViT forward of their own"
        )
        self.cache_misses = counter("cache_misses", "Image spans encoded by the ViT")
        self.queue_depth = gauge("queue_depth", "Encode calls waiting for a batch")
        self.saturation = gauge(
            "saturation",
            "How full this encoder is, 0..1: images waiting for a batch over "
            "--max-batch-images (EncodeScheduler.saturation). The autoscaling signal of "
            "deploy/k8s/components.",
        )
        self.stalled = gauge(
            "stalled",
            "1 while the batch loop is stuck (calls waiting, no batch for --watchdog-s) or dead",
        )
        # vLLM's names (no vision_encoder_ prefix), for dashboards built for it
        self.mm_cache_queries = telemetry.counter(
            "mm_cache_queries", "Image spans looked up in the embedding cache", registry=registry
        )
        self.mm_cache_hits = telemetry.counter(
            "mm_cache_hits", "Image spans found in the embedding cache", registry=registry
        )
        self.encode_latency = histogram(
            "encode_seconds",
            "Encode call latency, arrival to rows written (cache_only calls aside)",
        )
        self.cache_only_latency = histogram(
            "cache_only_seconds", "cache_only Encode call latency, arrival to rows cached"
        )
        self.cache_only_spans = counter(
            "cache_only_spans",
            "Image spans of successful cache_only calls (encoded ahead, or found cached)",
        )

    def _add_rank_metrics(self) -> None:
        """Each rank's share of the steps."""
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.images_encoded = counter("images_encoded", "Distinct images run through the ViT", RANK)
        self.vit_forwards = counter(
            "vit_forwards", "ViT forward calls (one per rank per batch)", RANK
        )
        self.cache_bytes = gauge("cache_bytes", "Bytes held by the rank's embedding cache", RANK)
        self.cache_entries = gauge("cache_entries", "Images in the rank's embedding cache", RANK)
        self.cache_evictions = counter(
            "cache_evictions", "Cache entries evicted to stay within the rank's byte budget", RANK
        )
        self.ledger_misses = counter(
            "ledger_misses",
            "Planned cache hits the owner did not hold (the call was planned again)",
            RANK,
        )
        self.preprocess_latency = histogram(
            "preprocess_seconds", "Decoding and pixel preparation of one rank's encodes in a batch"
        )
        self.vit_latency = histogram("vit_seconds", "ViT forward latency of one rank's batch")
        self.transfer_bytes = counter(
            "transfer_bytes", "Embedding bytes written to prefill buffers"
        )

    def record_step(self, result: EncodeStepResult) -> None:
        """One rank's counters of one step."""
        rank = str(result.rank)
        self.images_encoded.labels(rank=rank).inc(result.num_images_encoded)
        self.vit_forwards.labels(rank=rank).inc(result.num_vit_forwards)
        if result.num_vit_forwards:
            self.preprocess_latency.observe(result.preprocess_s)
            self.vit_latency.observe(result.vit_s)
        self.transfer_bytes.inc(result.num_bytes_sent)
        self.cache_bytes.labels(rank=rank).set(result.cache_bytes)
        self.cache_entries.labels(rank=rank).set(result.cache_entries)
        self.cache_evictions.labels(rank=rank).inc(len(result.manifest.evicted))
        self.ledger_misses.labels(rank=rank).inc(len(result.manifest.missing))
