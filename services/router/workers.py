"""The workers a router knows about and their state."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

DNS_SCHEME = "dns:///"


class WorkerKind(enum.Enum):
    TOKENIZER = "tokenizer"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODER = "vision_encoder"  # polled for health; prefill calls Encode, the router prefetches


class Hop(enum.Enum):
    """A call on a request's path that must make progress within the router's stall bound."""

    TOKENIZE = "tokenize"  # tokenizer: the Tokenize call
    RESERVE = "reserve"  # decode: the Reserve call
    PREFILL = "prefill"  # prefill: the Prefill call, until it returns the first token
    GENERATE = "generate"  # decode: each gap between two messages for a request's stream


class WorkerState(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet
    READY = "ready"  # its last health check said SERVING
    NOT_READY = "not_ready"  # its last health check failed or said NOT_SERVING


@dataclass(eq=False)
class Worker:
    """One worker process. ``client`` is its typed client (None for kinds the router never calls)."""

    kind: WorkerKind
    address: str
    client: Any = None
    state: WorkerState = WorkerState.UNKNOWN
    num_in_flight: int = 0  # requests this router routed here and not finished
    last_error: str = ""  # why the last health check failed
    num_passes: int = 0  # consecutive passing health checks
    num_timeouts: int = 0  # consecutive health checks it did not answer in time
    num_stalls: int = 0  # calls it made no progress on within the stall bound
    last_completed_mono: float = (
        0.0  # time.monotonic() when it last completed its part of a request
    )
    generate_error: str = ""  # set while ejected by a failed health-check generate
    is_leaving: bool = False  # gone from discovery's answer: no new requests, closed once idle
    idle_since_mono: float = 0.0  # time.monotonic() when its last request in flight ended

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY and not self.generate_error and not self.is_leaving


@dataclass(frozen=True)
class DnsName:
    """A worker address given as ``dns:///host:port``: every address ``host`` resolves to, each
    at ``port``, is one worker (a headless Service's name resolves to each ready pod)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.host}:{self.port}"


def parse_dns_name(address: str) -> DnsName | None:
    """The ``DnsName`` of a ``dns:///host:port`` address, None for a plain ``host:port``;
    ``ValueError`` for a ``dns:`` address of another form."""
    if not address.startswith("dns:"):
        return None
    rest = address.removeprefix(DNS_SCHEME)
    host, sep, port = rest.rpartition(":")
    if not address.startswith(DNS_SCHEME) or not sep or not host or "/" in rest:
        raise ValueError(f"worker address {address!r}: expected {DNS_SCHEME}HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {address!r}: port must be 1-65535")
    return DnsName(host.removeprefix("[").removesuffix("]"), int(port))
