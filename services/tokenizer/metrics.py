"""Prometheus metrics of the tokenizer service (names get the ``stageserve_`` prefix)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from services.common import telemetry

PROMPT_LEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class TokenizerMetrics:
    """One per process; tests pass their own registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = telemetry.counter(
            "tokenizer_requests",
            "Tokenizer RPCs by method and outcome (ok or the error's gRPC code).",
            ["method", "outcome"],
            registry,
        )
        self.tokenize_latency = telemetry.histogram(
            "tokenizer_tokenize_seconds",
            "Time to answer a Tokenize call (queueing in the worker pool included).",
            registry=registry,
        )
        self.prompt_tokens = telemetry.counter(
            "tokenizer_prompt_tokens",
            "Prompt tokens produced, image placeholders included.",
            registry=registry,
        )
        self.prompt_len = telemetry.histogram(
            "tokenizer_prompt_len_tokens",
            "Tokens per tokenized prompt.",
            buckets=PROMPT_LEN_BUCKETS,
            registry=registry,
        )
        self.images_decoded = telemetry.counter(
            "tokenizer_images_decoded",
            "Distinct images whose patch grid was found (from the header, or by decoding).",
            registry=registry,
        )
        self.image_bytes = telemetry.counter(
            "tokenizer_image_bytes",
            "Compressed bytes of the images received (one sent as its header adds none).",
            registry=registry,
        )
