"""Prometheus metrics of the vision encoder (names get the ``stageserve_`` prefix)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from services.common import telemetry


class VisionEncoderMetrics:
    """One set per process (``REGISTRY``); tests pass their own registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.cache_hits = telemetry.counter(
            "vision_encoder_cache_hits", "Image spans whose rows needed no ViT forward of their own", registry=r
        )
        self.cache_misses = telemetry.counter(
            "vision_encoder_cache_misses", "Image spans encoded by the ViT", registry=r
        )
        self.mm_cache_queries = telemetry.counter(
            "mm_cache_queries", "Image spans looked up in the embedding cache (vLLM's name)", registry=r
        )
        self.mm_cache_hits = telemetry.counter(
            "mm_cache_hits", "Image spans found in the embedding cache (vLLM's name)", registry=r
        )
        self.images_encoded = telemetry.counter(
            "vision_encoder_images_encoded", "Distinct images run through the ViT", registry=r
        )
        self.vit_forwards = telemetry.counter("vision_encoder_vit_forwards", "ViT forward calls (batches)", registry=r)
        self.cache_bytes = telemetry.gauge("vision_encoder_cache_bytes", "Bytes held by the embedding cache", registry=r)
        self.cache_entries = telemetry.gauge("vision_encoder_cache_entries", "Images in the embedding cache", registry=r)
        self.cache_evictions = telemetry.counter(
            "vision_encoder_cache_evictions", "Cache entries evicted to stay within the byte budget", registry=r
        )
        self.requests = telemetry.counter(
            "vision_encoder_requests", "Encode calls by outcome (ok or the error class)", ["outcome"], registry=r
        )
        self.stalled = telemetry.gauge(
            "vision_encoder_stalled",
            "1 while the engine thread is stuck (encodes waiting, no batch for --watchdog-s) or dead; 0 otherwise",
            registry=r,
        )
        self.queue_depth = telemetry.gauge("vision_encoder_queue_depth", "Encode calls waiting for a batch", registry=r)
        self.encode_latency = telemetry.histogram(
            "vision_encoder_encode_seconds", "Encode call latency, arrival to rows written", registry=r
        )
        self.vit_latency = telemetry.histogram("vision_encoder_vit_seconds", "ViT forward latency per batch", registry=r)
        self.transfer_bytes = telemetry.counter(
            "vision_encoder_transfer_bytes", "Embedding bytes written to prefill buffers", registry=r
        )
