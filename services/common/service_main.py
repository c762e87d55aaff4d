"""What every service's ``__main__`` shares: the common flags, logging, telemetry, the READY line.

Each service accepts ``--model --host --port --metrics-port --device --dtype --log-level
--log-format`` (the launcher passes the first five and ``--log-format`` to all of them),
``--internal-token-file``, ``--allow-unauthenticated`` and ``--enable-reflection``, and prints
one ``READY <service> port=<grpc> ... metrics_port=<port>`` line on stdout once it serves.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from services.common import logs, telemetry
from services.common.auth import AuthConfigError, Credentials, internal_credentials
from services.common.envs import INTERNAL_TOKEN_ENV, Envs
from services.common.paths import BUNDLED_MODEL


@dataclass(frozen=True)
class ServiceConfig:
    """The fields ``add_common_args`` fills; a service's config extends it with its own."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's
    log_level: str = "INFO"
    log_format: str = "text"  # text | json (one object per line)
    internal_token_file: Path | None = None  # wins over STAGESERVE_INTERNAL_TOKEN
    allow_unauthenticated: bool = False  # start without an internal token (no authentication)
    enable_reflection: bool = False  # serve gRPC server reflection


def add_common_args(
    parser: argparse.ArgumentParser, *, runs_model: bool = True, envs: Envs | None = None
) -> None:
    """Add the flags every service takes. Without ``runs_model``, ``--device`` and ``--dtype`` are
    accepted and unused. ``--log-level`` defaults to ``envs.log_level`` (``STAGESERVE_LOG_LEVEL``, else
    INFO), ``--log-format`` to ``envs.log_format`` (``STAGESERVE_LOG_FORMAT``, else text); ``envs``
    defaults to ``Envs.from_environ()``."""
    envs = envs if envs is not None else Envs.from_environ()
    p = parser
    p.add_argument(
        "--model", type=Path, default=BUNDLED_MODEL, help="Hugging Face checkpoint directory"
    )
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC and metrics servers bind")
    p.add_argument(
        "--port", type=int, default=0, help="gRPC port (0: a free one, printed on the READY line)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: a free one)"
    )
    if runs_model:
        p.add_argument("--device", default="cpu")
        p.add_argument(
            "--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)"
        )
    else:
        p.add_argument(
            "--device",
            default="cpu",
            help="unused (this service runs no model); accepted for uniformity",
        )
        p.add_argument("--dtype", default=None, help="unused; accepted for uniformity")
    p.add_argument(
        "--log-level",
        type=str.upper,
        default=envs.log_level,
        help="DEBUG, INFO, ... (default: STAGESERVE_LOG_LEVEL, else INFO)",
    )
    p.add_argument(
        "--log-format",
        type=str.lower,
        choices=logs.LOG_FORMATS,
        default=envs.log_format,
        help="text, or json: one object per line with request_id and trace_id "
        "(default: STAGESERVE_LOG_FORMAT, else text)",
    )
    p.add_argument(
        "--internal-token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"file holding the internal gRPC token (wins over {INTERNAL_TOKEN_ENV})",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="start without an internal token: internal gRPC calls are neither "
        "checked nor sent with credentials",
    )
    p.add_argument("--enable-reflection", action="store_true", help="serve gRPC server reflection")


def internal_credentials_or_exit(
    service: str, envs: Envs, token_file: Path | None, allow_unauthenticated: bool
) -> Credentials | None:
    """``auth.internal_credentials``, or exit with one ``<service>: error: ...`` line on stderr."""
    try:
        return internal_credentials(envs, token_file, allow_unauthenticated=allow_unauthenticated)
    except AuthConfigError as exc:
        raise SystemExit(f"{service}: error: {exc}") from None


def setup_logging(service: str, level: str, log_format: str) -> None:
    """Log to stderr as ``--log-level`` and ``--log-format`` say (``services.common.logs``); exits
    with one error line for a format it does not know (STAGESERVE_LOG_FORMAT is not checked by
    the flag's choices)."""
    try:
        logs.configure(service, level, log_format)
    except ValueError as exc:
        raise SystemExit(f"{service}: error: --log-format / STAGESERVE_LOG_FORMAT: {exc}") from None


def start_telemetry(
    service: str, envs: Envs, host: str, metrics_port: int, *, model_name: str
) -> int:
    """Start tracing and the ``/metrics`` server (``model_name`` on every sample); returns the
    metrics port actually bound. Exits with one ``<service>: error: ...`` line when an
    ``OTEL_*`` setting cannot be honoured."""
    try:
        telemetry.init_tracing(service, envs)
    except ValueError as exc:
        raise SystemExit(f"{service}: error: {exc}") from None
    return telemetry.start_metrics_server(
        metrics_port, host, service=service, model_name=model_name
    )


def print_ready(service: str, **ports: int) -> None:
    """``READY <service> port=... metrics_port=...`` on stdout, the line the launcher waits for."""
    print(
        " ".join(["READY", service, *(f"{name}={port}" for name, port in ports.items())]),
        flush=True,
    )
