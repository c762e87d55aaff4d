"""Log lines: text by default, JSON (one object per line) on request, both with the request's
``request_id`` and ``trace_id`` whenever the line is about a request."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.logs import JsonFormatter, RequestContextFilter, TextFormatter, configure
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
