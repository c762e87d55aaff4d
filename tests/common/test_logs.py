"""Log lines: text by default, JSON (one object per line) on request, both with the request's
``request_id`` and ``trace_id`` whenever the line is about a request."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.logs import (
    JsonFormatter,
    RateLimitFilter,
    RequestContextFilter,
    TextFormatter,
    configure,
)
from services.common.server import current_request_id
from tests.conftest import REPO

TRACER = TracerProvider().get_tracer("test")


def record(message: str, *args: object, exc_info: bool = False) -> logging.LogRecord:
    """A record made (and filtered) here, as a handler would see it."""
    logger = logging.getLogger("services.test")
    made = logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, args, None)
    if exc_info:
        made.exc_info = sys.exc_info()
    assert RequestContextFilter().filter(made)
    return made


def test_json_lines_carry_the_request_and_trace_ids() -> None:
    token = current_request_id.set("chatcmpl-42")
    try:
        with TRACER.start_as_current_span("router.request") as span:
            line = JsonFormatter("router").format(record("prefill of %s\nfailed", "chatcmpl-42"))
    finally:
        current_request_id.reset(token)
    assert "\n" not in line
    entry = json.loads(line)
    context = span.get_span_context()
    assert entry["request_id"] == "chatcmpl-42"
    assert (
        entry["trace_id"] == f"{context.trace_id:032x}"
        and entry["span_id"] == f"{context.span_id:016x}"
    )
    assert (entry["service"], entry["logger"], entry["level"]) == (
        "router",
        "services.test",
        "INFO",
    )
    assert entry["message"] == "prefill of chatcmpl-42\nfailed"
    assert entry["time"].endswith("Z")


def test_json_line_outside_a_request_has_null_ids_and_keeps_tracebacks_on_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        line = JsonFormatter("decode").format(record("it broke", exc_info=True))
    entry = json.loads(line)
    assert entry["request_id"] is None and entry["trace_id"] is None
    assert "RuntimeError: boom" in entry["exception"] and "\n" not in line


def test_text_lines_show_the_ids_only_when_there_are_some() -> None:
    formatter = TextFormatter()
    assert formatter.format(record("plain")).endswith(" INFO services.test: plain")
    token = current_request_id.set("gen-7")
    try:
        with TRACER.start_as_current_span("x") as span:
            line = formatter.format(record("about a request"))
    finally:
        current_request_id.reset(token)
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert line.endswith(f" services.test: [request_id=gen-7 trace_id={trace_id}] about a request")


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure("router", "INFO", "xml")


def test_a_json_process_logs_warnings_and_uncaught_errors_as_json() -> None:
    code = (
        "import logging, warnings\n"
        "from services.common.logs import configure\n"
        "configure('tokenizer', 'INFO', 'json')\n"
        "logging.getLogger('services.tokenizer').info('hello')\n"
        "warnings.warn('careful')\n"
        "raise RuntimeError('fatal')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert [e["message"] for e in entries[:1]] == ["hello"]
    assert "careful" in entries[1]["message"] and entries[1]["logger"] == "py.warnings"
    assert entries[2]["level"] == "CRITICAL" and "RuntimeError: fatal" in entries[2]["exception"]
    assert len(entries) == 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def captured() -> Iterator[tuple[list[logging.LogRecord], RateLimitFilter, FakeClock]]:
    """A logger ``test.flood`` whose records pass a ``RateLimitFilter`` (3 per 10 s, a fake
    clock) into a list."""
    clock = FakeClock()
    rate_limit = RateLimitFilter(max_records=3, window_s=10.0, clock=clock)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(rate_limit)
    logger = logging.getLogger("test.flood")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield records, rate_limit, clock
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_rate_limit_passes_a_few_of_a_template_then_reports_how_many_it_dropped(captured):
    records, _, clock = captured
    logger = logging.getLogger("test.flood")
    for i in range(1000):
        logger.warning("bad request from %s", f"10.0.0.{i}")
    logger.warning("another line")
    assert [r.getMessage() for r in records] == [
        "bad request from 10.0.0.0",
        "bad request from 10.0.0.1",
        "bad request from 10.0.0.2",
        "another line",
    ]
    clock.now += 10.0
    logger.warning("bad request from %s", "10.0.0.9")
    assert records[-2].getMessage() == (
        "dropped 997 more records like 'bad request from %s' (at most 3 every 10 s)"
    )
    assert records[-2].levelno == logging.WARNING and records[-2].name == "test.flood"
    assert records[-1].getMessage() == "bad request from 10.0.0.9"


def test_rate_limit_reports_drops_at_the_next_record_of_any_template(captured):
    records, _, clock = captured
    logger = logging.getLogger("test.flood")
    for _ in range(5):
        logger.error("flood")
    clock.now += 11.0
    logger.warning("something else")
    assert [r.getMessage() for r in records[-2:]] == [
        "dropped 2 more records like 'flood' (at most 3 every 10 s)",
        "something else",
    ]
    clock.now += 11.0
    logger.warning("quiet")
    assert records[-1].getMessage() == "quiet"  # nothing dropped since: no second report


def test_rate_limit_counts_levels_and_loggers_apart(captured):
    records, rate_limit, _ = captured
    other = logging.getLogger("test.flood.other")
    for _ in range(5):
        logging.getLogger("test.flood").warning("same")
        logging.getLogger("test.flood").error("same")
        other.warning("same")
    assert len(records) == 9


def test_a_service_log_bounds_the_asyncio_accept_error_flood() -> None:
    code = (
        "import asyncio, socket\n"
        "from services.common.logs import configure\n"
        "configure('router', 'INFO', 'text')\n"
        "loop = asyncio.new_event_loop()\n"
        "sock = socket.socket()\n"
        "for _ in range(20000):\n"
        "    try:\n"
        "        raise OSError(24, 'Too many open files')\n"
        "    except OSError as exc:\n"
        "        loop.call_exception_handler({'message': 'socket.accept() out of system "
        "resource', 'exception': exc, 'socket': sock})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("socket.accept() out of system resource") == 20
    assert len(result.stderr) < 20 * 2000
