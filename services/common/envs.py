"""Every environment variable stageserve reads, declared in one place.

Read once at start-up (``Envs.from_environ()``) and passed down; nothing else reads
``os.environ``. Third-party variables that we only document (``MC_*`` for Mooncake, the
``OTEL_*`` ones the OpenTelemetry SDK reads itself) are listed so operators find them here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

INTERNAL_TOKEN_ENV = "STAGESERVE_INTERNAL_TOKEN"
API_KEY_ENV = "STAGESERVE_API_KEY"

# Mooncake Transfer Engine tuning, read by the library itself (documented here only):
#   MC_TRANSFER_TIMEOUT                    seconds before a stuck transfer fails (default 30). A KV
#                                          write prefill abandoned at its deadline can still land in
#                                          decode's pages this long after it was issued, so decode
#                                          quarantines the pages of a reservation aborted or expired
#                                          before its KV was ready for --kv-quarantine-s (default 35),
#                                          which must stay above this value: raise both together.
#   MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER   TCP queue depth per peer (default 1024)
#   MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER TCP admissions per peer (default 1024)
MOONCAKE_ENV_VARS = (
    "MC_TRANSFER_TIMEOUT",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
)

# OpenTelemetry, read by the SDK and the OTLP exporters themselves as the specification says
# (documented here only; stageserve never overrides them):
#   OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES   the resource; service.name defaults to
#                                                 stageserve-<service>
#   OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT          where spans go (gRPC default localhost:4317; HTTP:
#                                                 the generic one gets /v1/traces appended)
#   OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE, _CLIENT_KEY,
#   _CLIENT_CERTIFICATE, _INSECURE (gRPC only)    the exporter's connection
#   OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG  the sampler (default parentbased_always_on);
#                                                 stageserve checks the values at start-up
#   OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
#   OTEL_BSP_EXPORT_TIMEOUT                       the batch span processor
#   OTEL_PROPAGATORS                              the propagators (default tracecontext,baggage)
#   OTEL_SDK_DISABLED                             "true": no spans recorded (also read below)
OTEL_SDK_ENV_VARS = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_PROPAGATORS",
    "OTEL_SDK_DISABLED",
)


@dataclass(frozen=True)
class Envs:
    log_level: str = "INFO"  # STAGESERVE_LOG_LEVEL
    log_format: str = "text"  # STAGESERVE_LOG_FORMAT: text | json (the default of --log-format)
    # What decides which span exporters run (the SDK reads the rest of OTEL_* itself):
    otel_sdk_disabled: bool = False  # OTEL_SDK_DISABLED=true: tracing off (no provider installed)
    # OTEL_TRACES_EXPORTER: comma-separated otlp | console | none; unset: otlp when an OTLP
    # endpoint variable is set, else none (no export attempts to a collector nobody runs)
    traces_exporter: str = ""
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL: grpc | http/protobuf;
    # unset: grpc (this project's default before the variable was honoured)
    otlp_protocol: str = ""
    otlp_endpoint: str = ""  # OTEL_EXPORTER_OTLP_ENDPOINT (passed to no exporter: they read it)
    otlp_traces_endpoint: str = ""  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (likewise)
    traces_sampler: str = ""  # OTEL_TRACES_SAMPLER, checked at start-up (the SDK applies it)
    traces_sampler_arg: str = ""  # OTEL_TRACES_SAMPLER_ARG, likewise
    trace_console: bool = False  # STAGESERVE_TRACE_CONSOLE=1: print finished spans (debugging)
    # STAGESERVE_INTERNAL_TOKEN: the shared secret internal gRPC calls carry and KV references are
    # signed with; `stageserve up` generates one for its children.
    internal_token: str = field(default="", repr=False)
    # STAGESERVE_API_KEY: the key the router's public API requires (the default of its --api-key).
    api_key: str = field(default="", repr=False)
    # GLIBC_TUNABLES (read by glibc itself): when it sets glibc.malloc.mmap_threshold or
    # trim_threshold, services.common.malloc leaves malloc's thresholds as glibc set them
    glibc_tunables: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Envs:
        env = os.environ if environ is None else environ
        return cls(
            log_level=env.get("STAGESERVE_LOG_LEVEL", "INFO").upper(),
            log_format=env.get("STAGESERVE_LOG_FORMAT", "text").strip().lower() or "text",
            otel_sdk_disabled=env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true",
            traces_exporter=env.get("OTEL_TRACES_EXPORTER", "").strip().lower(),
            otlp_protocol=(
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
            ).lower(),
            otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip(),
            otlp_traces_endpoint=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip(),
            traces_sampler=env.get("OTEL_TRACES_SAMPLER", "").strip().lower(),
            traces_sampler_arg=env.get("OTEL_TRACES_SAMPLER_ARG", "").strip(),
            trace_console=env.get("STAGESERVE_TRACE_CONSOLE", "") == "1",
            internal_token=env.get(INTERNAL_TOKEN_ENV, "").strip(),
            api_key=env.get(API_KEY_ENV, "").strip(),
            glibc_tunables=env.get("GLIBC_TUNABLES", ""),
        )
