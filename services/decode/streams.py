"""One caller's token streams on the decode leader: the requests of one Stream call.

The leader (on the event loop) adds each rank step's tokens for the connection's requests,
lists the requests that wait (``WAITING_LIST_S``) and ends requests; the Stream handler
takes everything that piled up since its last message as one ``StreamBatch``, so a
connection gets at most one message per rank step however many requests it carries (fewer
when its reader is behind). Single-threaded: the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.common.errors import StageServeError
from services.common.types import FinishReason, TokenLogprob, Usage

# How often a stepping rank lists its generating requests that got no token (waiting for a
# place in its running batch): the caller's progress bound (the router's --stall-timeout-s,
# which must be longer) sees them alive while their rank steps, and stalled when it does not.
WAITING_LIST_S = 0.25


@dataclass(frozen=True)
class RequestEnded:
    """The end of one request: finished (reason and usage) or failed (error)."""

    request_id: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: StageServeError | None = None


@dataclass
class StreamBatch:
    """What one message carries: tokens as parallel lists (in step order), the logprobs of
    those whose request asked (``logprobs[j]`` is ``token_ids[logprob_indices[j]]``'s), the
    ends, and the requests that wait."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprob_indices: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ends: list[RequestEnded] = field(default_factory=list)
    waiting_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.request_ids or self.ends or self.waiting_ids)


class Connection:
    """A Stream call's live requests and the batch waiting to be sent."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()  # started on this connection and not ended
        self._batch = StreamBatch()
        self._has_batch = asyncio.Event()
        self.error: StageServeError | None = None  # the stream itself failed (a malformed message)
        self.is_input_closed = False  # the caller sends no more messages

    @property
    def is_done(self) -> bool:
        """Nothing more can come: the caller stopped sending and every request ended."""
        return self.is_input_closed and not self.request_ids

    def add_token(self, request_id: str, token_id: int, logprob: TokenLogprob | None) -> None:
        if logprob is not None:
            self._batch.logprob_indices.append(len(self._batch.token_ids))
            self._batch.logprobs.append(logprob)
        self._batch.request_ids.append(request_id)
        self._batch.token_ids.append(token_id)
        self._has_batch.set()

    def add_waiting(self, request_id: str) -> None:
        """``request_id`` is live on a rank that stepped without a token for it."""
        self._batch.waiting_ids.append(request_id)
        self._has_batch.set()

    def end(self, ended: RequestEnded) -> None:
        """``ended.request_id`` leaves the connection; its end goes out with the next batch."""
        self.request_ids.discard(ended.request_id)
        self._batch.ends.append(ended)
        self._has_batch.set()

    def fail(self, error: StageServeError) -> None:
        """End the whole stream with ``error`` (the handler raises it after the pending batch)."""
        self.error = error
        self._has_batch.set()

    def close_input(self) -> None:
        """The caller half-closed: the stream ends once its last request has."""
        self.is_input_closed = True
        self._has_batch.set()

    async def next_batch(self) -> StreamBatch:
        """Everything since the previous call, waiting for something; empty once failed or done."""
        while not self._batch and self.error is None and not self.is_done:
            self._has_batch.clear()
            await self._has_batch.wait()
        batch, self._batch = self._batch, StreamBatch()
        return batch
