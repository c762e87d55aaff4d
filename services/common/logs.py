"""Log lines as text (the default) or one JSON object per line, with the request's ids.

``RateLimitFilter`` keeps a repeated line from flooding the log.
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
from collections.abc import Callable
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


class RateLimitFilter(logging.Filter):
    """Passes at most ``max_records`` records of one logger, level and message template (the
    unformatted ``msg``) in each ``window_s``, and drops the rest, so a flood of one line (an
    attacker's bad requests, asyncio's ``socket.accept() out of system resource``) cannot fill
    the disk. Once a window with dropped records has ended, the next record that reaches the
    filter (of any kind) is preceded by one WARNING of the same logger with their count."""

    def __init__(
        self,
        max_records: int = 20,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        assert max_records >= 1 and window_s > 0
        self._max_records = max_records
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str], list[float]] = {}  # key -> [start, num]
        self._next_sweep = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            ended = self._sweep(now) if now >= self._next_sweep else []
            window = self._windows.get(key)
            if window is None or now - window[0] >= self._window_s:
                if window is not None and window[1] > self._max_records:
                    ended.append((key, int(window[1]) - self._max_records))
                window = self._windows[key] = [now, 0]
            window[1] += 1
            is_passed = window[1] <= self._max_records
        for (name, _, template), num_dropped in ended:
            logging.getLogger(name).warning(
                "dropped %d more records like %r (at most %d every %.0f s)",
                num_dropped,
                template[:200],
                self._max_records,
                self._window_s,
            )
        return is_passed

    def _sweep(self, now: float) -> list[tuple[tuple[str, int, str], int]]:
        self._next_sweep = now + 1.0
        ended = [
            (key, window)
            for key, window in self._windows.items()
            if now - window[0] >= self._window_s
        ]
        for key, _ in ended:
            del self._windows[key]
        return [
            (key, int(window[1]) - self._max_records)
            for key, window in ended
            if window[1] > self._max_records
        ]


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
        if hasattr(record, "rank"):  # a rank process's records (services.common.ranks)
            entry["rank"] = record.rank
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
    handler.addFilter(RateLimitFilter())
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
