"""The router's configuration, built once from the command line."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.exposure import INSECURE_NO_API_KEY_FLAG
from services.common.service_main import ServiceConfig
from services.common.settings import (
    flag,
    nested,
    non_negative,
    non_negative_int,
    port_number,
    positive,
    positive_int,
)
from services.router.tool_parsers import ToolFormat
from services.router.workers import WorkerKind, parse_dns_name

AUTO_TOOL_CALL_PARSER = "auto"  # --tool-call-parser: the chat template's format


class PolicyName(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    CACHE_AWARE = "cache-aware"  # prefill: where the prompt's prefix was sent (policy.py)


def _address(kind: str) -> tuple[str, ...]:
    return flag(
        (),
        name=f"{kind}_address",
        metavar="HOST:PORT|dns:///NAME:PORT",
        repeatable=True,
        help=f"{kind} workers, comma-separated or the flag once each; dns:///NAME:PORT is "
        "every address NAME resolves to (a headless Service), re-resolved every "
        "--discovery-interval-s",
    )


@dataclass(frozen=True)
class WorkerAddresses:
    """Where the router finds each kind of worker: "host:port" each, or a ``dns:///name:port``
    that stands for every address the name resolves to (``services/router/discovery.py``)."""

    tokenizer: tuple[str, ...] = _address("tokenizer")
    prefill: tuple[str, ...] = _address("prefill")
    decode: tuple[str, ...] = _address("decode")
    # polled for /health only; prefill calls the encoder itself
    encoder: tuple[str, ...] = _address("encoder")
    discovery_interval_s: float = flag(
        5.0, type=positive, help="seconds between two resolutions of the dns:/// worker addresses"
    )

    def __post_init__(self) -> None:
        if not self.discovery_interval_s > 0:
            interval_s = self.discovery_interval_s
            raise ValueError(f"--discovery-interval-s must be > 0, got {interval_s}")
        for addresses in self.by_kind().values():
            for address in addresses:
                parse_dns_name(address)  # ValueError names a malformed one

    def by_kind(self) -> dict[WorkerKind, tuple[str, ...]]:
        return {
            WorkerKind.TOKENIZER: self.tokenizer,
            WorkerKind.PREFILL: self.prefill,
            WorkerKind.DECODE: self.decode,
            WorkerKind.ENCODER: self.encoder,
        }


MAX_IMAGE_BYTES = 20 * 1024 * 1024
# A router's shutdown after its drain: gRPC and HTTP grace, decode's last Aborts (router/app.py).
STOP_AFTER_DRAIN_S = 10.0


def default_max_request_bytes(max_image_bytes: int) -> int:
    """One image of the largest size as a base64 data URL (4/3 of its bytes) plus 4 MiB for
    text, JSON and a margin, so an image a little over the limit still gets the precise
    per-image 400; several smaller images fit too. 32,156,332 bytes for 20 MiB images."""
    return (max_image_bytes + 2) // 3 * 4 + 4 * 1024 * 1024


@dataclass(frozen=True)
class LimitsConfig:
    """Per-request bounds the router enforces before anything reaches a worker."""

    request_timeout_s: float = flag(300.0, help="per-request deadline")
    max_image_bytes: int = flag(MAX_IMAGE_BYTES, help="largest image, bytes (else 400)")
    image_fetch_timeout_s: float = flag(
        10.0, help="total time for fetching one image URL, redirects and body included"
    )
    max_stop_strings: int = 4
    max_n: int = flag(
        8,
        type=positive_int,
        help="most choices (n, times the prompts of a completions batch) a request may ask "
        "for, else 400",
    )
    default_max_tokens: int = flag(0, help="when a request sets none; 0 = up to the context")
    grammar_compile_timeout_s: float = flag(
        10.0,
        help="longest a grammar (response_format, structured_outputs, guided_*) may take to "
        "compile (else 400)",
    )
    # The public input surface: HTTP bodies and image URLs.
    max_request_bytes: int | None = flag(
        None,
        type=positive_int,
        help="largest HTTP request body, else 413 (default: one --max-image-bytes image "
        "as base64 + 4 MiB)",
    )
    allow_private_image_urls: bool = flag(
        False,
        help="also fetch image URLs on private, loopback, link-local and other "
        "non-public addresses",
    )
    max_image_redirects: int = flag(
        3, type=non_negative_int, help="redirects followed when fetching an image URL"
    )

    def __post_init__(self) -> None:
        if self.max_request_bytes is None:
            object.__setattr__(
                self, "max_request_bytes", default_max_request_bytes(self.max_image_bytes)
            )


@dataclass(frozen=True)
class HttpLimits:
    """Bounds the router's HTTP server holds on every connection, before a request reaches the
    app (``services/router/http_server.py``)."""

    max_connections: int = flag(
        4096,
        type=positive_int,
        help="open HTTP connections per router process; more get 503 at once and are closed "
        "(lowered to fit RLIMIT_NOFILE)",
    )
    max_header_bytes: int = flag(
        64 * 1024, type=positive_int, help="largest request line + headers, else 431"
    )
    max_headers: int = flag(
        100, type=positive_int, help="most header fields in a request, else 431"
    )
    header_timeout_s: float = flag(
        10.0,
        type=positive,
        help="a request's line and headers must arrive within this from the connection's start "
        "or the previous response's end, else 408 and the connection is closed",
    )
    body_timeout_s: float = flag(
        30.0,
        type=positive,
        help="a request body that sends nothing for this long has its connection closed",
    )
    keep_alive_timeout_s: float = flag(
        5.0, type=positive, help="an idle connection between two requests is closed after this"
    )

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

    stall_timeout_s: float = flag(
        10.0,
        help="each hop (tokenize, Reserve, prefill, each gap between decode messages) must "
        "answer within this, else the request ends UNAVAILABLE",
    )
    max_concurrent_requests: int = flag(256, help="requests past tokenization in flight at once")
    max_queued_requests: int = flag(1024, help="requests waiting for a slot; more get 429 at once")
    queue_timeout_s: float = flag(
        30.0, help="how long a request may wait for a slot and for KV pages in all, then 429"
    )

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
class RouterConfig(ServiceConfig):
    """The router's flags; ``__main__`` resolves the model name and the context limit from the
    checkpoint; ``http_host`` defaults to ``host``."""

    served_model_name: str | None = flag(None, help="model name in the API (default: the dir name)")
    max_context_len: int = flag(0, help="default: the model's max_position_embeddings")
    http_host: str | None = flag(None, help="HTTP bind address (default: --host)")
    http_port: int = flag(
        8000,
        type=port_number,
        help="OpenAI HTTP port (0 = any free port); /metrics is on --metrics-port",
    )
    http_reuse_port: bool = flag(
        False,
        help="share --http-port with other router processes started with this flag "
        "(SO_REUSEPORT: the kernel spreads new connections over them)",
    )
    workers: WorkerAddresses = nested(WorkerAddresses)
    policy: PolicyName = flag(
        PolicyName.CACHE_AWARE,
        type=PolicyName,
        choices=tuple(PolicyName),
        help="worker choice: round-robin; least-load (fewest requests in flight); cache-aware "
        "(prefill: the worker this router sent the prompt's longest prefix or its images to, "
        "where its prefix cache likely still holds them, unless that worker is busier than "
        "--cache-aware-max-imbalance allows; the other kinds least-load)",
    )
    cache_aware_max_imbalance: int = flag(
        8,
        type=non_negative_int,
        help="cache-aware: requests in flight a prefill worker may have beyond the least "
        "loaded one and still be chosen for its cache",
    )
    disable_prefix_cache: bool = flag(
        False,
        help="the prefill workers run with --disable-prefix-cache: a request's n choices all "
        "start at once (by default the choices after the first wait for its prefill, to read "
        "the prompt from prefill's prefix cache)",
    )
    tool_call_parser: str = flag(
        AUTO_TOOL_CALL_PARSER,
        choices=(AUTO_TOOL_CALL_PARSER, *ToolFormat),
        help="the format of tool calls in the model's output and of the tools in its prompt: "
        "hermes (Qwen2.5-VL, Qwen3-VL) or qwen3_coder (Qwen3-Coder, Qwen3.5); auto: "
        "qwen3_coder when the chat template writes <function=...> calls, else hermes",
    )
    prefetch_images: bool = flag(
        True,
        name="no_image_prefetch",
        help="leave a request's images to prefill's Encode call (default: with one encoder, "
        "send them to its cache as soon as the request is admitted)",
    )
    health_interval_s: float = flag(1.0, help="seconds between worker health polls")
    health_timeout_s: float = flag(1.0, help="timeout of one health check")
    health_eject_timeouts: int = flag(
        3,
        type=positive_int,
        help="consecutive timed-out health checks that eject a ready worker (one that answers "
        "not SERVING or cannot be reached is ejected at its first)",
    )
    health_readmit_passes: int = flag(
        2,
        type=positive_int,
        help="consecutive passing health checks that readmit an ejected worker (a worker not "
        "yet ready is admitted at its first)",
    )
    health_generate_interval_s: float = flag(
        30.0,
        type=non_negative,
        help="a worker that completed no request for this long runs a one-token health-check "
        "generate through tokenizer, prefill and decode; failing it ejects the worker "
        "until one passes (0: never)",
    )
    health_generate_timeout_s: float = flag(
        30.0, type=positive, help="a health-check generate that takes longer fails"
    )
    limits: LimitsConfig = nested(LimitsConfig)
    flow: FlowConfig = nested(FlowConfig)
    http: HttpLimits = nested(HttpLimits, prefix="http")
    drain_timeout_s: float | None = flag(
        None,
        type=non_negative,
        help="on SIGTERM: report not ready, refuse new requests (503) and give the ones in "
        "flight this long to finish, then end the rest with an error and exit "
        "(default: --request-timeout-s, the longest a request can run)",
    )
    insecure_no_api_key: bool = flag(
        False,
        name=INSECURE_NO_API_KEY_FLAG.removeprefix("--").replace("-", "_"),
        help="serve the API without a key although --host or --http-host is not a loopback "
        "address (anyone who reaches the ports may call it)",
    )

    def __post_init__(self) -> None:
        if self.http_host is None:
            object.__setattr__(self, "http_host", self.host)
        if self.tool_call_parser not in (AUTO_TOOL_CALL_PARSER, *ToolFormat):
            raise ValueError(
                f"--tool-call-parser must be auto, {', '.join(ToolFormat)}; "
                f"got {self.tool_call_parser!r}"
            )
        if self.drain_timeout_s is not None and not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")

    @property
    def drain_s(self) -> float:
        """How long a SIGTERM leaves the requests in flight to finish."""
        if self.drain_timeout_s is None:
            return self.limits.request_timeout_s
        return self.drain_timeout_s

    @property
    def stop_s(self) -> float:
        """The longest a SIGTERM takes to end the process: the drain, then the rest."""
        return self.drain_s + STOP_AFTER_DRAIN_S
