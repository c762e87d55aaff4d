"""Typed client of the decode service.

The proto <-> domain conversions it uses live in ``services.common.kv_ref`` (``KvRefInfo``)
and ``services.common.wire`` (sampling parameters, finish reasons, Stream errors).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import msgspec

from services.common import telemetry
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.common.grpc_errors import error_from_rpc
from services.common.kv_ref import KvRefInfo, kv_ref_from_proto
from services.common.pb.stageserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.server import REQUEST_ID_KEY
from services.common.types import FinishReason, SamplingParams, TokenLogprob, Usage
from services.common.wire import (
    finish_reason_from_proto,
    sampling_params_to_proto,
    stream_error_from_proto,
    token_logprob_from_proto,
    usage_from_proto,
)

DEFAULT_TIMEOUT_S = 10.0  # Abort / Stats, and the cap on Reserve when the deadline is far


class DecodeChunk(msgspec.Struct, frozen=True):
    """Tokens generated since the previous chunk; the last chunk carries finish_reason and usage.

    The stream never repeats ``first_token_id``: completion tokens = 1 + all streamed
    tokens, which is what ``usage.num_completion_tokens`` says. A chunk with no tokens and
    no finish says the request is live on a decode rank that steps, waiting for a place in
    its batch.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids when the request asked


class _Deadline:
    """Queued for a generate when its deadline passes."""


_DEADLINE = _Deadline()
Queued = DecodeChunk | StageServeError | _Deadline


def _trace_fields() -> dict[str, str]:
    """The current W3C trace context as DecodeGenerateRequest's traceparent / tracestate."""
    carrier = dict(telemetry.inject_metadata())
    return {key: carrier[key] for key in ("traceparent", "tracestate") if key in carrier}


class _TokenStream:
    """One Stream call carrying every ``generate`` of a client: each request's chunks to its queue.

    Messages to decode go through an unbounded outbox (never awaited by the caller); a
    reader task splits each message by request. When the call ends, every open request
    gets the error, and the next ``generate`` opens a new call.
    """

    def __init__(self, stub: decode_pb2_grpc.DecodeStub) -> None:
        self._outbox: asyncio.Queue[decode_pb2.DecodeStreamRequest | None] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[Queued]] = {}
        self.is_closed = False
        self._call = stub.Stream(self._messages(), metadata=telemetry.inject_metadata())
        self._reader = asyncio.create_task(self._read(), name="decode-token-stream")

    def open(self, request_id: str) -> asyncio.Queue[Queued]:
        if request_id in self._queues:
            raise InvalidRequestError(
                f"generate already started for {request_id}", param="request_id"
            )
        queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def send(self, message: decode_pb2.DecodeStreamRequest) -> None:
        if not self.is_closed:
            self._outbox.put_nowait(message)

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _messages(self) -> AsyncIterator[decode_pb2.DecodeStreamRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        error: StageServeError = UnavailableError("the decode service ended its token stream")
        try:
            async for response in self._call:
                self._dispatch(response)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, service="decode")
        except asyncio.CancelledError:
            error = UnavailableError("the decode client was closed")
            raise
        finally:
            self.is_closed = True
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()

    def _dispatch(self, response: decode_pb2.DecodeStreamResponse) -> None:
        tokens: dict[str, list[int]] = {}
        for request_id, token_id in zip(response.request_ids, response.token_ids, strict=True):
            tokens.setdefault(request_id, []).append(token_id)
        logprobs: dict[str, list[TokenLogprob]] = {}
        for i, message in zip(response.logprob_indices, response.logprobs, strict=True):
            logprobs.setdefault(response.request_ids[i], []).append(
                token_logprob_from_proto(message)
            )
        ends = {end.request_id: end for end in response.ends}
        for request_id in response.waiting_request_ids:
            queue = self._queues.get(request_id)
            if queue is not None and queue.empty():  # anything queued says as much already
                queue.put_nowait(DecodeChunk(()))
        for request_id in tokens.keys() | ends.keys():
            queue = self._queues.get(request_id)
            if queue is None:  # the caller left already
                continue
            token_ids, end = tuple(tokens.get(request_id, ())), ends.get(request_id)
            chunk = DecodeChunk(token_ids, logprobs=tuple(logprobs.get(request_id, ())))
            if end is None:
                queue.put_nowait(chunk)
            elif end.HasField("error"):
                if token_ids:
                    queue.put_nowait(chunk)
                queue.put_nowait(stream_error_from_proto(end.error))
            else:
                reason = finish_reason_from_proto(end.finish_reason)
                usage = usage_from_proto(end.usage)
                queue.put_nowait(msgspec.structs.replace(chunk, finish_reason=reason, usage=usage))


class DecodeRankStats(msgspec.Struct, frozen=True):
    dp_rank: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int  # neither free nor used: a late KV write may still land in them
    is_serving: bool = True  # False: the rank is down or restarting (every count 0)


class DecodeStats(msgspec.Struct, frozen=True):
    page_size: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int  # free + used + quarantined = total
    ranks: tuple[DecodeRankStats, ...] = ()


def _stats_fields(message: object, struct: type[msgspec.Struct]) -> dict[str, int]:
    return {name: getattr(message, name) for name in struct.__struct_fields__ if name != "ranks"}


class DecodeClient:
    """Async client of one decode service at ``address`` ("host:port")."""

    def __init__(
        self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, auth: Credentials | None = None
    ) -> None:
        """``auth``: the internal token sent on every call (None: none)."""
        self.address = address
        self._timeout_s = timeout_s
        self._channel = create_channel(address, auth=auth)
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)
        self._tokens: _TokenStream | None = None  # every generate of this client, one Stream call

    @staticmethod
    def _metadata(request_id: str) -> list[tuple[str, str]]:
        return telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        mrope_position_delta: int,
        params: SamplingParams,
        deadline_unix_s: float,
    ) -> KvRefInfo:
        """Reserve KV pages; returns where prefill writes the prompt's KV.

        ``deadline_unix_s``: the request's absolute deadline, seconds since the Unix epoch
        (``time.time()``); the reservation expires then unless Generate started. Raises
        ``CapacityError`` (no pages now; retryable elsewhere), ``InvalidRequestError``
        (bad params, prompt too long, duplicate id), ``DeadlineExceededError``,
        ``UnavailableError``.
        """
        remaining_s = deadline_unix_s - time.time()
        if remaining_s <= 0:
            raise DeadlineExceededError(f"{request_id}: deadline passed before Reserve")
        request = decode_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            mrope_position_delta=mrope_position_delta,
            sampling_params=sampling_params_to_proto(params),
            deadline_unix_ms=int(deadline_unix_s * 1000),
        )
        try:
            reply = await self._stub.Reserve(
                request,
                timeout=min(remaining_s, self._timeout_s),
                metadata=self._metadata(request_id),
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        return kv_ref_from_proto(reply.kv_ref)

    async def generate(
        self, request_id: str, first_token_id: int, timeout_s: float, *, kv_written_proof: bytes
    ) -> AsyncIterator[DecodeChunk]:
        """Stream the tokens after ``first_token_id`` until the request finishes.

        Every generate of this client shares one Stream call, whose messages carry every
        request's tokens of a decode step. ``kv_written_proof``: what prefill returned for
        this request (``PrefillResult``); decode starts no reservation without it. Leaving
        the iteration early (``break``, ``aclose``, cancellation) aborts the request on
        decode, which frees its pages. Raises ``NotFoundError`` (unknown or expired request),
        ``InvalidRequestError`` (missing or wrong proof), ``AbortedError`` (aborted meanwhile),
        ``DeadlineExceededError`` (``timeout_s`` passed), ``UnavailableError``.
        """
        if self._tokens is None or self._tokens.is_closed:
            self._tokens = _TokenStream(self._stub)
        tokens = self._tokens
        queue = tokens.open(request_id)
        deadline_mono = asyncio.get_running_loop().time() + timeout_s
        start = decode_pb2.DecodeGenerateRequest(
            request_id=request_id,
            first_token_id=first_token_id,
            kv_written_proof=kv_written_proof,
            deadline_unix_ms=int((time.time() + timeout_s) * 1000),
            **_trace_fields(),
        )
        tokens.send(decode_pb2.DecodeStreamRequest(generate=start))
        # One timer for the whole stream, not one per message: at the deadline it queues
        # _DEADLINE behind what came before it.
        expiry = asyncio.get_running_loop().call_at(deadline_mono, queue.put_nowait, _DEADLINE)
        is_done = False
        try:
            while not is_done:
                item = await queue.get()
                if isinstance(item, _Deadline):
                    raise DeadlineExceededError(
                        f"{request_id}: decode did not finish within {timeout_s:g} s"
                    )
                if isinstance(item, StageServeError):
                    is_done = True
                    raise item
                is_done = item.finish_reason is not None
                yield item
        finally:
            expiry.cancel()
            tokens.forget(request_id)
            if not is_done:
                abort = decode_pb2.AbortRequest(
                    request_id=request_id, reason="the caller left", is_kv_written=True
                )
                tokens.send(decode_pb2.DecodeStreamRequest(abort=abort))

    async def abort(
        self, request_id: str, reason: str = "", *, is_kv_written: bool = False
    ) -> bool:
        """Abort ``request_id`` wherever it is (idempotent); True when it was live.

        ``is_kv_written``: prefill returned successfully for this request, so no late KV
        write can land and decode frees a reservation's pages at once instead of
        quarantining them.
        """
        request = decode_pb2.AbortRequest(
            request_id=request_id, reason=reason, is_kv_written=is_kv_written
        )
        try:
            reply = await self._stub.Abort(
                request, timeout=self._timeout_s, metadata=self._metadata(request_id)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        return reply.is_found

    async def stats(self) -> DecodeStats:
        try:
            reply = await self._stub.Stats(
                decode_pb2.StatsRequest(),
                timeout=self._timeout_s,
                metadata=telemetry.inject_metadata(),
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="decode") from exc
        ranks = tuple(DecodeRankStats(**_stats_fields(r, DecodeRankStats)) for r in reply.ranks)
        return DecodeStats(**_stats_fields(reply, DecodeStats), ranks=ranks)

    async def close(self) -> None:
        if self._tokens is not None:
            await self._tokens.close()
        await self._channel.close()
