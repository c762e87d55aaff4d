"""An ASGI middleware in front of the HTTP API that refuses request bodies over a byte limit.

A request whose ``Content-Length`` is over the limit is answered 413 before any of its
body is read. A body without one (chunked) or longer than it claims is counted as it
arrives and refused at the first chunk over the limit. Bodies within the limit are
buffered here (at most the limit) and handed to the app as one message, so nothing
behind this middleware can read more than the limit; a large body is joined off the event loop
(``services.common.offload``).

The whole 413 is written at once; the connection then closes. Before closing, up to
``DRAIN_MAX_BYTES`` / ``DRAIN_MAX_S`` of the rest of the body is read and discarded:
clients that read the reply only after sending everything (httpx, requests) get the
413 instead of a reset connection, which they would retry.

Once a request whose body was large has been answered, ``MemoryReleaser`` hands the memory its
copies took back to the OS (``services.common.malloc``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.common.malloc import MemoryReleaser
from services.common.offload import sized
from services.router.openai_format import dump_json, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_MAX_S = 5.0


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        assert max_request_bytes > 0
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.releaser = MemoryReleaser()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            await self._refuse(receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                await self._refuse(receive, send, more_body=message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = _replay(await sized(size, b"".join, chunks), receive)
        chunks.clear()
        try:
            await self.app(scope, replay, send)
        finally:
            del replay
            self.releaser.request_done(size)

    async def _refuse(self, receive: Receive, send: Send, *, more_body: bool = True) -> None:
        message = f"the request body is larger than the limit of {self.max_request_bytes} bytes"
        body = dump_json(
            error_body(message, "invalid_request_error", code="request_too_large")
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        # The whole body goes out now; the response ends (and the server stops reading) after the
        # drain.
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if more_body:
            await _drain(receive)
        await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive) -> None:
    num_bytes = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_MAX_S):
            while num_bytes <= DRAIN_MAX_BYTES:
                message = await receive()
                num_bytes += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser refuses it before the app sees the request
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that first returns the whole buffered body, then the server's messages."""
    is_sent = False

    async def replayed() -> Message:
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
