"""Log lines as text (the default) or one JSON object per line, with the request's ids.

``RequestContextFilter`` puts on every record the id of the request being handled
(``services.common.server.current_request_id``: the RPC's ``x-request-id``, or the router's
own id inside its pipeline) and the current span's ``trace_id`` / ``span_id``. The text
format shows them after the logger name when set; the JSON format always has the keys
(null when the line is about no request).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from types import TracebackType

from opentelemetry import trace

from services.common.server import current_request_id

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s:%(request_ids)s %(message)s"


class RequestContextFilter(logging.Filter):
    """Adds ``request_id``, ``trace_id`` and ``span_id`` ("" when none) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        context = trace.get_current_span().get_span_context()
        is_valid = context.is_valid
        record.trace_id = trace.format_trace_id(context.trace_id) if is_valid else ""
        record.span_id = trace.format_span_id(context.span_id) if is_valid else ""
        return True


class TextFormatter(logging.Formatter):
    """``<time> <level> <logger>: [request_id=... trace_id=...] <message>``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        values = {key: getattr(record, key, "") for key in ("request_id", "trace_id")}
        ids = [f"{key}={value}" for key, value in values.items() if value]
        record.request_ids = f" [{' '.join(ids)}]" if ids else ""
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message or traceback are escaped)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _utc_time(record.created),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "") or None,
            "trace_id": getattr(record, "trace_id", "") or None,
            "span_id": getattr(record, "span_id", "") or None,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _utc_time(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def configure(service: str, level: str, log_format: str) -> None:
    """Log to stderr at ``level`` in ``log_format`` (``LOG_FORMATS``), once per process.

    In JSON, Python warnings and uncaught exceptions (main thread and others) are logged
    records too, so the stream stays one object per line.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if log_format == "json":
        logging.captureWarnings(True)
        hook = _UncaughtLogger(logging.getLogger(f"services.{service}"))
        sys.excepthook = hook
        threading.excepthook = lambda args: hook(args.exc_type, args.exc_value, args.exc_traceback)


class _UncaughtLogger:
    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def __call__(
        self, exc_type: type[BaseException], value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._logger.critical("uncaught %s", exc_type.__name__, exc_info=(exc_type, value, tb))
