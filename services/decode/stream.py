"""Events of one request, handed from the engine thread to its Generate handler's event loop."""

from __future__ import annotations

import asyncio
import enum

import msgspec

from services.decode.scheduler import TokenEvent


class EndKind(enum.Enum):
    ABORTED = "aborted"  # Abort, or the stream was cancelled
    FAILED = "failed"  # the engine stopped or broke


class RequestEnded(msgspec.Struct, frozen=True):
    """The request ended without finishing; no event follows."""

    request_id: str
    kind: EndKind
    message: str


DecodeEvent = TokenEvent | RequestEnded


def is_final(event: DecodeEvent) -> bool:
    return isinstance(event, RequestEnded) or event.finish_reason is not None


class RequestStream:
    """An unbounded queue of one request's events: ``push`` from any thread, read on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[DecodeEvent] = asyncio.Queue()

    def push(self, event: DecodeEvent) -> None:
        """Thread-safe; events arrive in push order."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next_events(self) -> list[DecodeEvent]:
        """Every event queued now, waiting for at least one."""
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        return events
