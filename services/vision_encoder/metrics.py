"""Prometheus metrics of the vision encoder (names get the ``stageserve_`` prefix).

The leader keeps them all; the per-rank ones (label ``rank``) come from each rank's step
results.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from services.common import telemetry
from services.vision_encoder.rank_messages import EncodeStepResult


class VisionEncoderMetrics:
    """One set per process (``REGISTRY``); tests pass their own registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        rank = ["rank"]
        self.cache_hits = telemetry.counter(
            "vision_encoder_cache_hits",
            "Image spans whose rows needed no ViT forward of their own",
            registry=r,
        )
        self.cache_misses = telemetry.counter(
            "vision_encoder_cache_misses", "Image spans encoded by the ViT", registry=r
        )
        self.images_encoded = telemetry.counter(
            "vision_encoder_images_encoded", "Distinct images run through the ViT", rank, registry=r
        )
        self.vit_forwards = telemetry.counter(
            "vision_encoder_vit_forwards", "ViT forward calls (one per rank per batch)", rank, registry=r
        )
        self.cache_bytes = telemetry.gauge(
            "vision_encoder_cache_bytes", "Bytes held by the rank's embedding cache", rank, registry=r
        )
        self.cache_entries = telemetry.gauge(
            "vision_encoder_cache_entries", "Images in the rank's embedding cache", rank, registry=r
        )
        self.cache_evictions = telemetry.counter(
            "vision_encoder_cache_evictions",
            "Cache entries evicted to stay within the rank's byte budget",
            rank,
            registry=r,
        )
        self.ledger_misses = telemetry.counter(
            "vision_encoder_ledger_misses",
            "Planned cache hits the owner rank did not hold (its call was planned again)",
            rank,
            registry=r,
        )
        self.requests = telemetry.counter(
            "vision_encoder_requests",
            "Encode calls by outcome (ok or the error class)",
            ["outcome"],
            registry=r,
        )
        self.stalled = telemetry.gauge(
            "vision_encoder_stalled",
            "1 while the batch loop is stuck (encodes waiting, no batch for --watchdog-s) or dead",
            registry=r,
        )
        self.queue_depth = telemetry.gauge(
            "vision_encoder_queue_depth", "Encode calls waiting for a batch", registry=r
        )
        self.encode_latency = telemetry.histogram(
            "vision_encoder_encode_seconds", "Encode call latency, arrival to rows written", registry=r
        )
        self.preprocess_latency = telemetry.histogram(
            "vision_encoder_preprocess_seconds",
            "Decoding and pixel preparation of one rank's encodes in a batch",
            registry=r,
        )
        self.vit_latency = telemetry.histogram(
            "vision_encoder_vit_seconds", "ViT forward latency of one rank's batch", registry=r
        )
        self.transfer_bytes = telemetry.counter(
            "vision_encoder_transfer_bytes", "Embedding bytes written to prefill buffers", registry=r
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
