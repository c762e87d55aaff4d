"""The router's configuration, built once from the command line."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class PolicyName(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"


@dataclass(frozen=True)
class WorkerAddresses:
    """Where the router finds each kind of worker ("host:port" each)."""

    tokenizer: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    encoder: tuple[str, ...] = ()  # polled for /health only; prefill calls the encoder itself


MAX_IMAGE_BYTES = 20 * 1024 * 1024


def default_max_request_bytes(max_image_bytes: int) -> int:
    """One image of the largest size as a base64 data URL (4/3 of its bytes) plus 4 MiB for
    text, JSON and a margin, so an image a little over the limit still gets the precise
    per-image 400; several smaller images fit too. 32,156,332 bytes for 20 MiB images."""
    return (max_image_bytes + 2) // 3 * 4 + 4 * 1024 * 1024


@dataclass(frozen=True)
class LimitsConfig:
    """Per-request bounds the router enforces before anything reaches a worker."""

    request_timeout_s: float = 300.0
    max_image_bytes: int = MAX_IMAGE_BYTES
    image_fetch_timeout_s: float = 10.0  # the whole fetch of one image URL, redirects included
    max_stop_strings: int = 4
    # Generation budget when the client names none; 0 = up to the context limit.
    default_max_tokens: int = 0
    # The public input surface: HTTP bodies and image URLs.
    max_request_bytes: int = default_max_request_bytes(MAX_IMAGE_BYTES)  # HTTP 413 above
    allow_private_image_urls: bool = False  # fetch image URLs on private/loopback/... addresses
    max_image_redirects: int = 3


@dataclass(frozen=True)
class HttpLimits:
    """Bounds the router's HTTP server holds on every connection, before a request reaches the
    app (``services/router/http_server.py``)."""

    max_connections: int = 4096  # open in one process; more get 503 at once and are closed
    max_header_bytes: int = 64 * 1024  # request line + headers, else 431
    max_headers: int = 100  # header fields, else 431
    header_timeout_s: float = 10.0  # a request head must arrive within this, else 408
    body_timeout_s: float = 30.0  # a body with no new bytes for this long: connection closed
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed after this

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--http-{name.replace('_', '-')} must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--http-{name.replace('_', '-')} must be > 0")


@dataclass(frozen=True)
class FlowConfig:
    """How the router bounds each hop's progress and admits requests under load."""

    # The tokenize call, Reserve, the prefill call and each gap between two decode
    # messages must answer within this, else the request ends UNAVAILABLE.
    stall_timeout_s: float = 10.0
    max_concurrent_requests: int = 256  # requests past tokenization in flight at once
    max_queued_requests: int = 1024  # requests waiting for a slot; more get 429 at once
    queue_timeout_s: float = 30.0  # a request waits this long in all (slot, KV pages), then 429

    def __post_init__(self) -> None:
        if not self.stall_timeout_s > 0:
            raise ValueError(f"--stall-timeout-s must be > 0, got {self.stall_timeout_s}")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if not self.queue_timeout_s >= 0:
            raise ValueError(f"--queue-timeout-s must be >= 0, got {self.queue_timeout_s}")


@dataclass(frozen=True)
class RouterConfig:
    model_dir: Path
    served_model_name: str
    max_context_len: int  # prompt + generated tokens may not exceed this
    workers: WorkerAddresses = field(default_factory=WorkerAddresses)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    http: HttpLimits = field(default_factory=HttpLimits)
    policy: PolicyName = PolicyName.ROUND_ROBIN
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    # a worker that completed no request for this long runs a health-check generate; 0 = never
    health_generate_interval_s: float = 30.0
    health_generate_timeout_s: float = 30.0  # a health-check generate slower than this ejects
    host: str = "127.0.0.1"  # gRPC
    port: int = 0  # gRPC
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    http_reuse_port: bool = False  # share http_port with other router processes (SO_REUSEPORT)
    prefetch_images: bool = True  # a request's images to the encoder's cache once admitted
    metrics_port: int = 0
    log_level: str = "INFO"
    log_format: str = "text"  # text | json
