"""Request bodies parsed by msgspec, several times faster than the standard library on the
router's event loop.

FastAPI reads a JSON body through ``Request.json()``; ``FastJSONRoute`` hands its handlers a
request whose ``json()`` decodes with msgspec. What msgspec refuses (NaN and Infinity
literals, numbers out of range, lone surrogate escapes, UTF-16 or UTF-32 bodies, nesting
too deep, malformed JSON) goes to ``json.loads`` as before, so every body is accepted or
refused as FastAPI would and every error is the one it raised before; for the rest the two
decode to equal values (tests/router/test_fast_json.py). A large body is decoded off the event
loop (``services.common.offload``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from services.common.offload import sized


def decode_json(body: bytes) -> Any:
    """``json.loads(body)``, by msgspec where it accepts the body."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # nested too deep: json.loads says so its way
        return json.loads(body)


class FastJSONRequest(Request):
    async def body(self) -> bytes:
        """Starlette's ``body``, without its copy of a body that arrived as one message (its
        stream ends with an empty chunk, so it always joined two)."""
        if not hasattr(self, "_body"):
            chunks = [chunk async for chunk in self.stream() if chunk]
            self._body = (
                chunks[0]
                if len(chunks) == 1
                else await sized(sum(map(len, chunks)), b"".join, chunks)
            )
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await sized(len(body), decode_json, body)
        return self._json


class FastJSONRoute(APIRoute):
    """An ``APIRoute`` whose handler gets a ``FastJSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return route_handler
