"""gRPC face of the decode service: proto in, commands to the leader, proto out."""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from services.common import signing, telemetry
from services.common.deadlines import deadline_mono
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.kv_ref import issue_kv_ref, kv_ref_to_proto
from services.common.pb.stageserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.server import current_request_id
from services.common.wire import (
    finish_reason_to_proto,
    sampling_params_from_proto,
    stream_error_to_proto,
    token_logprob_to_proto,
    usage_to_proto,
)
from services.decode import metrics
from services.decode.leader import DecodeLeader
from services.decode.messages import RankLoad, ReserveCommand
from services.decode.streams import Connection, RequestEnded, StreamBatch

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
_tracer = telemetry.tracer("decode")
_LOAD_FIELDS = (
    "num_total_pages",
    "num_free_pages",
    "num_used_pages",
    "num_running_requests",
    "num_reserved_requests",
    "num_quarantined_pages",
)


def _end_to_proto(ended: RequestEnded) -> decode_pb2.RequestEnd:
    message = decode_pb2.RequestEnd(request_id=ended.request_id)
    if ended.error is not None:
        message.error.CopyFrom(stream_error_to_proto(ended.error))
    else:
        assert ended.finish_reason is not None and ended.usage is not None
        message.finish_reason = finish_reason_to_proto(ended.finish_reason)
        message.usage.CopyFrom(usage_to_proto(ended.usage))
    return message


def _response(batch: StreamBatch) -> decode_pb2.DecodeStreamResponse:
    return decode_pb2.DecodeStreamResponse(
        request_ids=batch.request_ids,
        token_ids=batch.token_ids,
        ends=[_end_to_proto(e) for e in batch.ends],
        waiting_request_ids=batch.waiting_ids,
        logprobs=[token_logprob_to_proto(logprob) for logprob in batch.logprobs],
        logprob_indices=batch.logprob_indices,
    )


class _Spans:
    """One ``decode.generate`` span per request of a stream, from its generate to its end."""

    def __init__(self) -> None:
        self._open: dict[str, Span] = {}

    def start(self, request: decode_pb2.DecodeGenerateRequest) -> None:
        carrier = [("traceparent", request.traceparent), ("tracestate", request.tracestate)]
        parent = telemetry.extract_context([(key, value) for key, value in carrier if value])
        span = _tracer.start_span(
            "decode.generate", context=parent, attributes={"request_id": request.request_id}
        )
        old = self._open.pop(request.request_id, None)
        if old is not None:
            old.end()
        self._open[request.request_id] = span

    def request_context(self, request_id: str) -> contextvars.Context:
        """A context whose log lines name ``request_id`` and its trace (the stream carries many)."""
        context = contextvars.copy_context()
        span = self._open.get(request_id)

        def enter() -> None:
            current_request_id.set(request_id)
            if span is not None:
                otel_context.attach(trace.set_span_in_context(span))

        context.run(enter)
        return context

    def end(self, batch: StreamBatch) -> None:
        for ended in batch.ends:
            span = self._open.pop(ended.request_id, None)
            if span is None:
                continue
            if ended.error is not None:
                telemetry.mark_error(span, ended.error)
            else:
                assert ended.finish_reason is not None and ended.usage is not None
                span.set_attribute("finish_reason", ended.finish_reason.value)
                span.set_attribute("gen_ai.usage.output_tokens", ended.usage.num_completion_tokens)
            span.end()

    def close(self) -> None:
        for span in self._open.values():
            span.set_status(Status(StatusCode.ERROR, "the stream ended first"))
            span.end()
        self._open.clear()


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Serves one leader; registered before the ranks form, UNAVAILABLE until ``attach``.

    Signs every KvRef it issues with ``kv_ref_key`` (the internal secret's key) and starts
    a reservation only with the proof prefill derives from it (``signing.kv_written_proof``).
    """

    def __init__(
        self,
        reservation_timeout_s: float,
        max_reservation_s: float,
        kv_ref_key: bytes,
        leader: DecodeLeader | None = None,
    ) -> None:
        assert 0 < reservation_timeout_s <= max_reservation_s
        self._reservation_timeout_s = reservation_timeout_s
        self._max_reservation_s = max_reservation_s
        self._kv_ref_key = kv_ref_key
        self._attached = leader

    def attach(self, leader: DecodeLeader) -> None:
        self._attached = leader

    @property
    def _leader(self) -> DecodeLeader:
        if self._attached is None:
            raise UnavailableError("decode is still forming its ranks")
        return self._attached

    def _lifetime(self, deadline_unix_ms: int) -> tuple[float, int]:
        """How long the reservation lives, and when it expires in Unix ms (the KvRef's).

        Until the request's deadline (``reservation_timeout_s`` from now when unset), and
        never longer than ``max_reservation_s``.
        """
        now_unix = time.time()
        asked_s = self._reservation_timeout_s
        if deadline_unix_ms > 0:
            asked_s = deadline_unix_ms / 1000 - now_unix
        lifetime_s = min(asked_s, self._max_reservation_s)
        return lifetime_s, int((now_unix + lifetime_s) * 1000)

    @handle_errors
    async def Reserve(
        self, request: decode_pb2.ReserveRequest, context: Any
    ) -> decode_pb2.ReserveResponse:
        """Place the request on a rank and take its pages; returns the signed KvRef for prefill."""
        with telemetry.rpc_span(
            _tracer,
            "decode.reserve",
            context.invocation_metadata(),
            request_id=request.request_id,
            **{"gen_ai.usage.input_tokens": len(request.prompt_token_ids)},
        ) as span:
            leader = self._leader
            nonce = signing.new_nonce()
            lifetime_s, expires_unix_ms = self._lifetime(request.deadline_unix_ms)
            command = ReserveCommand(
                request_id=request.request_id,
                prompt_ids=tuple(request.prompt_token_ids),
                params=sampling_params_from_proto(request.sampling_params),
                rope_delta=request.mrope_position_delta,
                lifetime_s=lifetime_s,
                kv_written_proof=signing.kv_written_proof(
                    self._kv_ref_key, request.request_id, nonce
                ),
            )
            destinations, dp_rank = await leader.reserve(command)
            span.set_attribute("dp_rank", dp_rank)
            kv_ref = issue_kv_ref(
                destinations[0],
                self._kv_ref_key,
                nonce,
                expires_unix_ms,
                dp_rank,
                tp_destinations=destinations[1:],
            )
        return decode_pb2.ReserveResponse(kv_ref=kv_ref_to_proto(kv_ref))

    @handle_errors
    async def Stream(
        self, requests: AsyncIterator[decode_pb2.DecodeStreamRequest], context: Any
    ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
        """Generate and abort messages in; one message per rank step out (see the proto)."""
        leader = self._leader
        conn, spans = Connection(), _Spans()
        aborts: set[asyncio.Task] = set()
        reader = asyncio.create_task(self._read(requests, conn, spans, aborts, leader))
        try:
            while True:
                batch = await conn.next_batch()
                if batch:
                    spans.end(batch)
                    metrics.STREAM_MESSAGES.inc()
                    yield _response(batch)
                if conn.error is not None:
                    raise conn.error
                if conn.is_done:
                    return
        finally:
            reader.cancel()
            leader.close_connection(conn)
            spans.close()

    async def _read(
        self,
        requests: AsyncIterator[decode_pb2.DecodeStreamRequest],
        conn: Connection,
        spans: _Spans,
        aborts: set[asyncio.Task],
        leader: DecodeLeader,
    ) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "generate":
                    start = message.generate
                    spans.start(start)
                    leader.generate(
                        conn,
                        start.request_id,
                        start.first_token_id,
                        start.kv_written_proof,
                        # a Stream carries many requests: its gRPC deadline is none of theirs
                        deadline_mono(start.deadline_unix_ms, None, math.inf),
                    )
                elif kind == "abort":
                    abort = message.abort
                    task = asyncio.create_task(
                        leader.abort(
                            abort.request_id, abort.reason, is_kv_written=abort.is_kv_written
                        ),
                        context=spans.request_context(abort.request_id),
                    )
                    aborts.add(task)
                    task.add_done_callback(aborts.discard)
                else:
                    conn.fail(InvalidRequestError("a Stream message must carry generate or abort"))
                    return
        finally:
            conn.close_input()

    @handle_errors
    async def Abort(
        self, request: decode_pb2.AbortRequest, context: Any
    ) -> decode_pb2.AbortResponse:
        """Abort wherever the request is; idempotent. Quarantines a reservation's pages unless is_kv_written."""
        is_found = await self._leader.abort(
            request.request_id, request.reason, is_kv_written=request.is_kv_written
        )
        return decode_pb2.AbortResponse(is_found=is_found)

    @handle_errors
    async def Stats(
        self, request: decode_pb2.StatsRequest, context: Any
    ) -> decode_pb2.StatsResponse:
        """Pages and requests of each DP rank, and their sums over the ranks that serve."""
        loads = self._leader.rank_loads()
        ranks = [_rank_stats(dp_rank, load) for dp_rank, load in enumerate(loads)]
        sums = {name: sum(getattr(rank, name) for rank in ranks) for name in _LOAD_FIELDS}
        page_size = next((load.page_size for load in loads if load is not None), 0)
        return decode_pb2.StatsResponse(page_size=page_size, ranks=ranks, **sums)


def _rank_stats(dp_rank: int, load: RankLoad | None) -> decode_pb2.DecodeRankStats:
    if load is None:
        return decode_pb2.DecodeRankStats(dp_rank=dp_rank, is_serving=False)
    counts = {name: getattr(load, name) for name in _LOAD_FIELDS}
    return decode_pb2.DecodeRankStats(dp_rank=dp_rank, is_serving=True, **counts)
