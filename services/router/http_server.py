"""The router's HTTP/1.1 server: uvicorn's httptools protocol with bounds that hold before any
request reaches the app (so before the API-key check).

Per connection, in this order of its life:

- accepted: past ``max_connections`` open connections in this process it gets a ``503`` with
  ``Retry-After`` at once and is closed, so the process never runs out of file descriptors
  (``connection_budget`` keeps the limit under RLIMIT_NOFILE).
- reading a request head (request line and headers): from the connection's start, or from the
  end of the previous response, the whole head must arrive within ``header_timeout_s``, else
  ``408`` and close (a connection that sent nothing is closed without a reply). More than
  ``max_header_bytes`` of head, or more than ``max_headers`` header fields: ``431``. The bytes are
  counted as they arrive, before the parser buffers them, so an oversized head costs at most
  one socket read beyond the limit (twice the limit for a head pipelined behind a request).
- reading a body: no body byte for ``body_timeout_s`` (while the server is not itself holding
  the reading back) closes the connection, with ``408`` when no response has started.
- idle between requests: uvicorn's keep-alive timeout (``keep_alive_timeout_s``).

A refusal (``431``, ``408``) is written at once, the sending side is shut down, and what the
client still sends is read and discarded (at most ``DRAIN_MAX_BYTES`` / ``DRAIN_S``) so it
reads the reply instead of a reset; nothing of it is kept.

An HTTP/1.0 client gets a response without a length (a stream) with ``Connection: close`` and
no chunked framing: the body ends where the connection closes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from services.router.config import HttpLimits
from services.router.openai_format import dump_json, error_body

logger = logging.getLogger(__name__)

DRAIN_MAX_BYTES = 1024 * 1024
DRAIN_S = 2.0
FD_RESERVE = 256  # descriptors kept for gRPC, worker clients, image fetches, logs
# asyncio accepts up to its server's ``backlog`` sockets in one go; an accepted socket is refused
# (closed) up to 3 event-loop turns later, while more batches are accepted. The kernel's queue of
# connections not yet accepted is set apart from it (``LISTEN_BACKLOG``).
ACCEPT_BATCH = 128
NUM_ACCEPT_BATCHES = 4
LISTEN_BACKLOG = 2048
RETRY_AFTER_S = 1
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


class _HeaderLimitError(Exception):
    pass


def connection_budget(max_connections: int) -> int:
    """``max_connections``, lowered (with a warning) to fit this process's RLIMIT_NOFILE (whose
    soft limit is first raised to the hard one) beside ``FD_RESERVE`` and the accept batches."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, exc)
    num_kept = FD_RESERVE + NUM_ACCEPT_BATCHES * ACCEPT_BATCH
    if soft == resource.RLIM_INFINITY or max_connections <= soft - num_kept:
        return max_connections
    budget = max(1, soft - num_kept)
    logger.warning(
        "--http-max-connections %d lowered to %d: RLIMIT_NOFILE is %d and %d descriptors "
        "are kept for the router's other sockets and the accept backlog",
        max_connections,
        budget,
        soft,
        num_kept,
    )
    return budget


def protocol_class(limits: HttpLimits) -> Callable[..., asyncio.Protocol]:
    """What ``uvicorn.Config(http=...)`` takes: a ``BoundedHttpToolsProtocol`` factory."""
    return functools.partial(BoundedHttpToolsProtocol, limits=limits)


def error_response(status: int, message: str, code: str, *extra: tuple[bytes, bytes]) -> bytes:
    """A whole ``Connection: close`` response with an OpenAI-style JSON error body."""
    error_type = "server_overloaded" if status == 503 else "invalid_request_error"
    body = dump_json(error_body(message, error_type, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *extra,
    ]
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return b"HTTP/1.1 %d %s\r\n%s\r\n%s" % (status, _REASONS[status], head, body)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = limits.keep_alive_timeout_s
        self._limits = limits
        self._is_reading_head = True
        self._head_bytes = 0
        self._is_reading_body = False
        self._last_body_mono = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._drained_bytes: int | None = None  # not None: refused, discarding what arrives

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._limits.max_connections:
            self.transport = transport
            self._drained_bytes = 0
            logger.warning(
                "refused a connection: %d connections open (--http-max-connections)",
                len(self.connections),
            )
            message = "the router has too many open connections; retry later"
            retry_after = (b"retry-after", str(RETRY_AFTER_S).encode())
            transport.write(error_response(503, message, "too_many_connections", retry_after))
            transport.close()
            return
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._drained_bytes is not None:
            self._drain(len(data))
            return
        self._unset_keepalive_if_required()
        if not self._is_reading_head:
            self._feed(data)
        elif self._head_bytes + len(data) <= self._limits.max_header_bytes:
            self._head_bytes += len(data)
            self._feed(data)
        else:
            self._feed_bounded(memoryview(data))
        if (
            self._is_reading_body
            and self._body_timer is None
            and self._drained_bytes is None
            and not self.transport.is_closing()
        ):
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._body_timeout)

    def _feed_bounded(self, data: memoryview) -> None:
        while data and self._drained_bytes is None and not self.transport.is_closing():
            if not self._is_reading_head:
                self._feed(data)
                return
            budget = self._limits.max_header_bytes - self._head_bytes
            if budget <= 0:
                self._refuse_head(
                    f"the request head is larger than the limit of "
                    f"{self._limits.max_header_bytes} bytes"
                )
                return
            self._head_bytes += min(budget, len(data))
            self._feed(data[:budget])
            data = data[budget:]

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeaderLimitError):
                self._refuse_head(str(exc.__context__))
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self._limits.max_headers:
            raise _HeaderLimitError(
                f"the request has more than the limit of {self._limits.max_headers} header fields"
            )
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._is_reading_head = False
        self._head_bytes = 0
        self._cancel_head_timer()
        self._is_reading_body = True
        self._last_body_mono = self.loop.time()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._last_body_mono = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._is_reading_head = True
        self._is_reading_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None and self._head_timer is None:
            # idle, waiting for the next request's head
            self._head_timer = self.loop.call_later(
                self._limits.header_timeout_s, self._head_timeout
            )

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if cycle.scope["http_version"] == "1.0":
            cycle.send = _CloseDelimitedSend(cycle)  # type: ignore[method-assign]
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        self._refuse(error_response(400, msg, "invalid_http_request"))

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes == 0:
            self.transport.close()  # idle: nothing of a request arrived
            return
        message = f"the request head did not arrive within {self._limits.header_timeout_s} s"
        logger.info("closed a connection: %s", message)
        self._refuse(error_response(408, message, "request_timeout"))

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self._is_reading_body:
            return
        idle_s = self.loop.time() - self._last_body_mono
        if self.flow.read_paused:  # the server holds the reading back, not the client
            self._last_body_mono = self.loop.time()
            idle_s = 0.0
        if idle_s < self._limits.body_timeout_s:
            delay_s = self._limits.body_timeout_s - idle_s
            self._body_timer = self.loop.call_later(delay_s, self._body_timeout)
            return
        message = f"no request body arrived for {self._limits.body_timeout_s} s"
        logger.info("closed a connection: %s", message)
        cycle = self.cycle
        can_answer = cycle is not None and not cycle.response_started and not self.pipeline
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() returns http.disconnect
            cycle.message_event.set()
        if can_answer:
            self._refuse(error_response(408, message, "request_timeout"))
        else:
            self.transport.close()

    def _refuse_head(self, message: str) -> None:
        logger.info("refused a request head: %s", message)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is being written: no room for a 431
            return
        self._refuse(error_response(431, message, "request_header_fields_too_large"))

    def _refuse(self, response: bytes) -> None:
        self._cancel_timers()
        self._drained_bytes = 0
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._head_timer = self.loop.call_later(DRAIN_S, self.transport.close)

    def _drain(self, num_bytes: int) -> None:
        assert self._drained_bytes is not None
        self._drained_bytes += num_bytes
        if self._drained_bytes > DRAIN_MAX_BYTES:
            self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


class _CloseDelimitedSend:
    """``RequestResponseCycle.send`` for an HTTP/1.0 request: a response without a length is
    written without chunked framing and ends by closing the connection (HTTP/1.0 has no
    keep-alive here, so uvicorn adds ``Connection: close``)."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._send = cycle.send
        self._is_close_delimited = False

    async def __call__(self, message: Any) -> None:
        cycle = self._cycle
        if message["type"] == "http.response.start" and not cycle.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            if not {b"content-length", b"transfer-encoding"} & names:
                cycle.chunked_encoding = False
                self._is_close_delimited = cycle.scope["method"] != "HEAD"
        is_body = message["type"] == "http.response.body"
        if not (self._is_close_delimited and is_body and not cycle.response_complete):
            await self._send(message)
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        cycle.transport.write(message.get("body", b""))
        if not message.get("more_body", False):
            cycle.response_complete = True
            cycle.message_event.set()
            cycle.transport.close()
            cycle.on_response()
