"""What every service's ``__main__`` shares: the common flags, logging, telemetry, the READY line.

Each service accepts ``--model --host --port --metrics-port --device --dtype --log-level
--log-format`` (the launcher passes the first five and ``--log-format`` to all of them),
``--internal-token-file``, ``--allow-unauthenticated`` and ``--enable-reflection``, and prints
one ``READY <service> port=<grpc> ... metrics_port=<port>`` line on stdout once it serves.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

from services.common import logs, telemetry
from services.common.auth import AuthConfigError, Credentials, internal_credentials
from services.common.envs import INTERNAL_TOKEN_ENV, Envs
from services.common.paths import BUNDLED_MODEL
from services.common.server import HealthState, Registration, create_server
from services.common.settings import add_config_args, flag


@dataclass(frozen=True)
class ServiceConfig:
    """The flags every service takes; a service's config extends it with its own."""

    model: Path = flag(BUNDLED_MODEL, help="Hugging Face checkpoint directory")
    host: str = flag("127.0.0.1", help="address the gRPC and metrics servers bind")
    port: int = flag(0, help="gRPC port (0: a free one, printed on the READY line)")
    metrics_port: int = flag(0, help="Prometheus /metrics port (0: a free one)")
    device: str = flag("cpu", help="where the model runs: cpu, cuda, cuda:N")
    dtype: str | None = flag(None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    log_level: str = flag(
        "INFO", type=str.upper, help="DEBUG, INFO, ... (default: STAGESERVE_LOG_LEVEL, else INFO)"
    )
    log_format: str = flag(
        "text",
        type=str.lower,
        choices=logs.LOG_FORMATS,
        help="text, or json: one object per line with request_id and trace_id "
        "(default: STAGESERVE_LOG_FORMAT, else text)",
    )
    internal_token_file: Path | None = flag(
        None,
        metavar="PATH",
        help=f"file holding the internal gRPC token (wins over {INTERNAL_TOKEN_ENV})",
    )
    allow_unauthenticated: bool = flag(
        False,
        help="start without an internal token: internal gRPC calls are neither "
        "checked nor sent with credentials",
    )
    enable_reflection: bool = flag(False, help="serve gRPC server reflection")


COMMON_SETTINGS = frozenset(f.name for f in fields(ServiceConfig))

_UNUSED_MODEL_FLAGS = {
    "device": "unused (this service runs no model); accepted for uniformity",
    "dtype": "unused; accepted for uniformity",
}


def env_defaults(envs: Envs | None = None) -> dict[str, str]:
    """The common flags whose default comes from the environment (``Envs``)."""
    envs = envs if envs is not None else Envs.from_environ()
    return {"log_level": envs.log_level, "log_format": envs.log_format}


def add_common_args(
    parser: argparse.ArgumentParser, *, runs_model: bool = True, envs: Envs | None = None
) -> None:
    """Add the flags every service takes (``ServiceConfig``'s). Without ``runs_model``,
    ``--device`` and ``--dtype`` are accepted and unused. ``--log-level`` defaults to
    ``envs.log_level`` (``STAGESERVE_LOG_LEVEL``, else INFO), ``--log-format`` to
    ``envs.log_format`` (``STAGESERVE_LOG_FORMAT``, else text); ``envs`` defaults to
    ``Envs.from_environ()``."""
    helps = {} if runs_model else _UNUSED_MODEL_FLAGS
    add_config_args(parser, ServiceConfig, defaults=env_defaults(envs), helps=helps)


def build_service_parser(
    prog: str,
    description: str,
    config_cls: type,
    *,
    runs_model: bool = True,
    envs: Envs | None = None,
) -> argparse.ArgumentParser:
    """A service's parser: the common flags, then ``config_cls``'s own (``settings``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    helps = {} if runs_model else _UNUSED_MODEL_FLAGS
    add_config_args(parser, config_cls, defaults=env_defaults(envs), helps=helps)
    return parser


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
    os.environ["STAGESERVE_LOG_FORMAT"] = log_format  # its rank processes log the same way
    os.environ["STAGESERVE_LOG_SERVICE"] = service


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


def service_server(
    registration: Registration,
    service_name: str,
    config: ServiceConfig,
    health: HealthState,
    auth: Credentials | None,
) -> tuple[grpc.aio.Server, int]:
    """A service's gRPC server (bound, not started) on its config's host, port and reflection
    setting; ``auth``: the internal token callers must send (None: none)."""
    return create_server(
        [registration],
        config.port,
        config.host,
        [service_name],
        health=health,
        auth=auth,
        enable_reflection=config.enable_reflection,
    )


def print_listening(service: str, port: int) -> None:
    """``LISTENING <service> port=...`` on stdout once the gRPC server is bound (health answers,
    NOT_SERVING until ready): a launcher may start the services that wait for this one then."""
    print(f"LISTENING {service} port={port}", flush=True)


def print_ready(service: str, **ports: int) -> None:
    """``READY <service> port=... metrics_port=...`` on stdout, the line the launcher waits for."""
    print(
        " ".join(["READY", service, *(f"{name}={port}" for name, port in ports.items())]),
        flush=True,
    )
