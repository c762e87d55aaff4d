"""gRPC face of the decode service: proto in, domain types to the engine, proto out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from services.common import signing, telemetry
from services.common.clients.decode import (
    FINISH_REASON_TO_PROTO,
    issue_kv_ref,
    kv_ref_to_proto,
    sampling_params_from_proto,
)
from services.common.errors import AbortedError, StageServeError, UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.engine import DecodeEngine
from services.decode.scheduler import DecodeRequest
from services.decode.stream import DecodeEvent, EndKind, RequestEnded, RequestStream

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
_tracer = telemetry.tracer("decode")


def _error(event: RequestEnded) -> StageServeError:
    if event.kind is EndKind.ABORTED:
        return AbortedError(event.message)
    return UnavailableError(event.message)


def _response(events: list[DecodeEvent]) -> tuple[decode_pb2.DecodeGenerateResponse, bool]:
    """One message for every event queued now; True when it is the stream's last."""
    token_ids: list[int] = []
    for event in events:
        if isinstance(event, RequestEnded):
            raise _error(event)
        token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            assert event.usage is not None
            usage = common_pb2.Usage(
                num_prompt_tokens=event.usage.num_prompt_tokens,
                num_completion_tokens=event.usage.num_completion_tokens,
            )
            reason = FINISH_REASON_TO_PROTO[event.finish_reason]
            return decode_pb2.DecodeGenerateResponse(token_ids=token_ids, finish_reason=reason, usage=usage), True
    return decode_pb2.DecodeGenerateResponse(token_ids=token_ids), False


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Serves one engine; registered before the model loads, UNAVAILABLE until ``attach``.

    Signs every KvRef it issues with ``kv_ref_key`` (the internal secret's key) and starts
    a reservation only with the proof prefill derives from it (``signing.kv_written_proof``).
    """

    def __init__(
        self,
        reservation_timeout_s: float,
        max_reservation_s: float,
        kv_ref_key: bytes,
        engine: DecodeEngine | None = None,
    ) -> None:
        assert 0 < reservation_timeout_s <= max_reservation_s
        self._reservation_timeout_s = reservation_timeout_s
        self._max_reservation_s = max_reservation_s
        self._kv_ref_key = kv_ref_key
        self._attached = engine

    def attach(self, engine: DecodeEngine) -> None:
        self._attached = engine

    @property
    def _engine(self) -> DecodeEngine:
        if self._attached is None:
            raise UnavailableError("decode is still loading its model")
        return self._attached

    def _lifetime(self, deadline_unix_ms: int) -> tuple[float, int]:
        """When the reservation expires: on the engine's monotonic clock, and in Unix ms (KvRef).

        The request's deadline (``reservation_timeout_s`` from now when unset), and never
        later than ``max_reservation_s`` from now.
        """
        now_mono, now_unix = time.monotonic(), time.time()
        asked_s = self._reservation_timeout_s
        if deadline_unix_ms > 0:
            asked_s = deadline_unix_ms / 1000 - now_unix
        lifetime_s = min(asked_s, self._max_reservation_s)
        return now_mono + lifetime_s, int((now_unix + lifetime_s) * 1000)

    @handle_errors
    async def Reserve(self, request: decode_pb2.ReserveRequest, context: Any) -> decode_pb2.ReserveResponse:
        """Take pages and open the KV transfer session; returns the signed KvRef for prefill."""
        with telemetry.rpc_span(
            _tracer, "decode.reserve", context.invocation_metadata(), request_id=request.request_id,
            **{"gen_ai.usage.input_tokens": len(request.prompt_token_ids)},
        ):
            nonce = signing.new_nonce()
            deadline_s, expires_unix_ms = self._lifetime(request.deadline_unix_ms)
            decode_request = DecodeRequest(
                request_id=request.request_id,
                prompt_ids=tuple(request.prompt_token_ids),
                params=sampling_params_from_proto(request.sampling_params),
                rope_delta=request.mrope_position_delta,
                kv_written_proof=signing.kv_written_proof(self._kv_ref_key, request.request_id, nonce),
            )
            destination = self._engine.reserve(decode_request, deadline_s)
            kv_ref = issue_kv_ref(destination, self._kv_ref_key, nonce, expires_unix_ms)
        return decode_pb2.ReserveResponse(kv_ref=kv_ref_to_proto(kv_ref))

    @handle_errors
    async def Generate(
        self, request: decode_pb2.DecodeGenerateRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeGenerateResponse]:
        """Admit the reservation (its KV proven written), stream its tokens; cancelling aborts it."""
        parent = telemetry.extract_context(context.invocation_metadata())
        span = _tracer.start_span("decode.generate", context=parent, attributes={"request_id": request.request_id})
        stream = RequestStream(asyncio.get_running_loop())
        is_admitted = is_done = False
        num_streamed = 0
        try:
            self._engine.generate(
                request.request_id, request.first_token_id, request.kv_written_proof, stream.push
            )
            is_admitted = True
            while not is_done:
                message, is_done = _response(await stream.next_events())
                num_streamed += len(message.token_ids)
                if is_done:
                    span.set_attribute("finish_reason", common_pb2.FinishReason.Name(message.finish_reason))
                    num_output = message.usage.num_completion_tokens
                    span.set_attribute("gen_ai.usage.output_tokens", num_output)
                yield message
        except StageServeError as exc:
            telemetry.mark_error(span, exc)
            raise
        finally:
            if is_admitted and not is_done:  # error, abort, or the caller went away: free the pages
                self._engine.abort(request.request_id, "the Generate stream ended early")
            span.set_attribute("num_streamed_tokens", num_streamed)
            span.end()

    @handle_errors
    async def Abort(self, request: decode_pb2.AbortRequest, context: Any) -> decode_pb2.AbortResponse:
        """Abort wherever the request is; idempotent. Quarantines a reservation's pages unless is_kv_written."""
        is_found = self._engine.abort(request.request_id, request.reason, is_kv_written=request.is_kv_written)
        return decode_pb2.AbortResponse(is_found=is_found)

    @handle_errors
    async def Stats(self, request: decode_pb2.StatsRequest, context: Any) -> decode_pb2.StatsResponse:
        """Pages and requests of the (single) DP rank, and their sums."""
        stats = self._engine.stats()
        counts = {
            "num_total_pages": stats.num_total_pages,
            "num_free_pages": stats.num_free_pages,
            "num_used_pages": stats.num_used_pages,
            "num_running_requests": stats.num_running_requests,
            "num_reserved_requests": stats.num_reserved_requests,
            "num_quarantined_pages": stats.num_quarantined_pages,
        }
        rank = decode_pb2.DecodeRankStats(dp_rank=0, **counts)
        return decode_pb2.StatsResponse(page_size=stats.page_size, ranks=[rank], **counts)
