"""Every environment variable stageserve reads, declared in one place.

Read once at start-up (``Envs.from_environ()``) and passed down; nothing else reads
``os.environ``. Third-party variables that we only document (``MC_*`` for Mooncake)
are listed so operators find them here.
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


@dataclass(frozen=True)
class Envs:
    log_level: str = "INFO"  # STAGESERVE_LOG_LEVEL
    otlp_endpoint: str = ""  # OTEL_EXPORTER_OTLP_ENDPOINT: export spans over OTLP when set
    trace_console: bool = False  # STAGESERVE_TRACE_CONSOLE=1: print finished spans (debugging)
    # STAGESERVE_INTERNAL_TOKEN: the shared secret internal gRPC calls carry and KV references are
    # signed with; `stageserve up` generates one for its children.
    internal_token: str = field(default="", repr=False)
    # STAGESERVE_API_KEY: the key the router's public API requires (the default of its --api-key).
    api_key: str = field(default="", repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Envs:
        env = os.environ if environ is None else environ
        return cls(
            log_level=env.get("STAGESERVE_LOG_LEVEL", "INFO").upper(),
            otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
            trace_console=env.get("STAGESERVE_TRACE_CONSOLE", "") == "1",
            internal_token=env.get(INTERNAL_TOKEN_ENV, "").strip(),
            api_key=env.get(API_KEY_ENV, "").strip(),
        )
